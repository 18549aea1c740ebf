"""The OpenAI-compatible HTTP server: routes, request schema, streaming generation, Prometheus metrics."""

"""Prometheus metrics of a serving engine, named like vLLM's (`vllm:` → `qwen35:`) so its dashboards carry over.

Latency histograms are fed by the engine's Observer hooks, which run on the engine thread once per token: they only
observe a number. Gauges and token counters are read from the scheduler and EngineStats when /metrics is scraped,
so they cost nothing while serving. Request counts are per sequence (a request with n = 2 counts twice).

The two halves are made at different times: the observer before the engine (the engine takes it in its
constructor), the scrape-time collector once the engine exists (`register_engine_metrics`), both on one registry.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from qwen35_jax.engine.engine import Engine, Observer

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class PrometheusObserver(Observer):
    """Latency histograms and the finish-reason counter, recorded into `registry` by the engine's hooks."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        def hist(name, doc, buckets=LATENCY_BUCKETS):
            return Histogram(f"qwen35:{name}", doc, ["model_name"], buckets=buckets,
                             registry=registry).labels(model_name)
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first generated token.")
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive tokens of a sequence.", ITL_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds", "Mean time per output token after the first, per "
                         "finished sequence.", ITL_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to admission (slot and KV pages reserved).")
        self.prefill = hist("request_prefill_time_seconds", "Admission to first token.")
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish (any reason).")
        self._finished = Counter("qwen35:request_success", "Finished sequences by finish reason "
                                 "(stop, length, abort, error).", ["model_name", "finished_reason"], registry=registry)
        self._model_name = model_name
        self._by_reason = {}

    def on_first_token(self, req):
        self.ttft.observe(req.first_token_time - req.arrival_time)
        if req.first_scheduled_time is not None:
            self.queue.observe(req.first_scheduled_time - req.arrival_time)
            self.prefill.observe(req.first_token_time - req.first_scheduled_time)

    def on_token(self, req, seconds_since_last: float):
        self.itl.observe(seconds_since_last)

    def on_finish(self, req):
        self.e2e.observe(time.monotonic() - req.arrival_time)
        if len(req.output_ids) > 1 and req.first_token_time is not None and req.last_token_time is not None:
            self.tpot.observe((req.last_token_time - req.first_token_time) / (len(req.output_ids) - 1))
        reason = req.finish_reason or "unknown"
        child = self._by_reason.get(reason)
        if child is None:
            child = self._by_reason[reason] = self._finished.labels(self._model_name, reason)
        child.inc()


def register_engine_metrics(registry: CollectorRegistry, engine: Engine, model_name: str):
    """Export the engine's scheduler gauges and token counters from `registry` (read at scrape time); once per
    registry."""
    registry.register(_EngineCollector(engine, model_name))


class _EngineCollector:
    """Scheduler occupancy and token counters, read at scrape time."""

    def __init__(self, engine: Engine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def collect(self):
        e, s, labels = self.engine, self.engine.scheduler, [self.model_name]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(f"qwen35:{name}", doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(f"qwen35:{name}", doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        yield gauge("num_requests_running", "Sequences holding a slot (prefilling or decoding).", len(s.running))
        yield gauge("num_requests_waiting", "Sequences queued for a slot and KV pages.", len(s.waiting))
        yield gauge("kv_cache_usage_perc", "Fraction of KV pages reserved (0..1).", s.kv_usage)
        yield gauge("state_slot_usage_perc", "Fraction of GDN state slots in use (0..1).", s.slot_usage)
        yield gauge("engine_healthy", "1 while the engine loop is alive.", 1.0 if e.healthy else 0.0)
        yield counter("prompt_tokens", "Prompt tokens prefilled.", e.stats.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", e.stats.generation_tokens)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache (not prefilled).", s.prefix_hits)
        if e.spec_tokens:      # vLLM's spec_decode counters
            k, st = e.spec_tokens, e.stats
            yield counter("spec_decode_num_drafts", "Speculative row-steps verified.", st.spec_steps)
            yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", k * st.spec_steps)
            yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", int(st.spec_accepted.sum()))
            per_pos = CounterMetricFamily("qwen35:spec_decode_num_accepted_tokens_per_pos",
                                          "Draft tokens accepted, by position in the draft.",
                                          labels=["model_name", "position"])
            for pos, n in enumerate(st.spec_accepted):
                per_pos.add_metric(labels + [str(pos)], int(n))
            yield per_pos
        yield counter("engine_steps", "Engine steps dispatched.", e.stats.steps)
        yield counter("engine_host_seconds", "Engine-thread host work not hidden behind the device (schedule, "
                      "build inputs, detokenize, stream).", e.stats.host_seconds)
        yield counter("engine_wait_seconds", "Engine-thread time blocked reading back device results.",
                      e.stats.wait_seconds)

"""Run `python -m qwen35_jax.serve` as a real process on a loopback port for the server tests.

Start-up is bounded (the process must print its address and answer /health within `timeout` seconds, or the test
fails with the log's tail) and the process is always stopped at teardown (SIGTERM, then SIGKILL): the launcher is
bench/serving.py's `Server`.
"""
from __future__ import annotations

import os
import re

import httpx

from bench.serving import Server
from conftest import XLA_CACHE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_KEY = "test-key"
# The engine shapes of conftest.engine_args(): executables come from the shared persistent XLA cache.
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens",
                "64", "--max-prefill-rows", "4", "--compilation-cache-dir", XLA_CACHE]


def server_env() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


class ServerProcess(Server):
    """The benchmark's server launcher, with the test environment (CPU, 8 simulated devices); the log is deleted
    at stop."""

    def __init__(self, args: list[str], timeout: float = 600.0, env: dict | None = None):
        super().__init__(args, timeout, env or server_env(), keep_log=False)


_http = httpx.Client(timeout=30)      # one client: httpx builds an SSL context per client, slow on a busy CPU


def http() -> httpx.Client:
    return _http


def metric(url: str, name: str, **labels) -> float:
    """One sample of a Prometheus metric from /metrics (0 if absent)."""
    text = _http.get(url + "/metrics").text
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric_name, _, label_text = head.partition("{")
        if metric_name != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', label_text))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(value)
    return 0.0

"""Run `python -m qwen35_jax.serve` as a real process on a loopback port for the server tests.

Start-up is bounded (the process must print its address and answer /health within `timeout` seconds, or the test
fails with the log's tail) and the process is always stopped at teardown (SIGTERM, then SIGKILL).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import warnings

import httpx

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


_LIBC = None
if sys.platform.startswith("linux"):
    import ctypes
    _LIBC = ctypes.CDLL(None, use_errno=True)      # loaded here: the child between fork and exec only calls it


def die_with_parent():
    """preexec_fn: the child gets SIGKILL if the process that started it dies (Linux), so a killed test run
    leaves no server behind."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG


class ServerProcess:
    def __init__(self, args: list[str], timeout: float = 240.0, env: dict | None = None):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="qwen35-serve-", suffix=".log", delete=False)
        with warnings.catch_warnings():     # JAX warns on any fork; this child only calls prctl, then exec
            warnings.filterwarnings("ignore", message="os.fork", category=RuntimeWarning)
            self.proc = subprocess.Popen([sys.executable, "-m", "qwen35_jax.serve", "--port", "0", *args],
                                         stdout=self.log, stderr=subprocess.STDOUT, env=env or server_env(), cwd=ROOT,
                                         start_new_session=True, preexec_fn=die_with_parent)
        self.url = None
        try:
            self._wait(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait(self, timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            if self.url is None:
                m = re.search(r"serving .* on (http://\S+)", open(self.log.name).read())
                self.url = m.group(1) if m else None
            if self.url is not None:
                try:
                    if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.5)
        raise TimeoutError(f"server not healthy after {timeout:.0f}s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        return open(self.log.name).read()[-n:]

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)
        self.log.close()
        os.unlink(self.log.name)


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

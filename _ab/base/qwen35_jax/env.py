"""The environment variables qwen35_jax reads, all in one place; every other setting is an argument.

QWEN35_JAX_CACHE  where built models, the XLA compilation cache, serialized executables and profiles live
                  (default ~/.cache/qwen35_jax)
QWEN35_API_KEY    the server's --api-key default
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID
                  JAX's own names for a multi-process job, the defaults of the serve flags of the same meaning
XLA_FLAGS         XLA's own flags: they shape every compile of the process, so they key the cached executables
"""
from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class Environment:
    cache_root: str
    api_key: str | None
    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    xla_flags: str


def _int(name: str) -> int | None:
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    if not text.isdigit():
        raise ValueError(f"${name} must be a non-negative integer, got {text!r}")
    return int(text)


def read() -> Environment:
    """The environment as it is now (read on each call: tests and notebooks may change it)."""
    return Environment(
        cache_root=os.environ.get("QWEN35_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "qwen35_jax"),
        api_key=os.environ.get("QWEN35_API_KEY") or None,
        coordinator_address=os.environ.get("JAX_COORDINATOR_ADDRESS") or None,
        num_processes=_int("JAX_NUM_PROCESSES"),
        process_id=_int("JAX_PROCESS_ID"),
        xla_flags=os.environ.get("XLA_FLAGS", ""))


def cache_root() -> str:
    return read().cache_root

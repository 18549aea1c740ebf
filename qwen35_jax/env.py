"""The environment variables qwen35_jax reads, all in one place; every other setting is an argument.

QWEN35_JAX_CACHE  where built models, the XLA compilation cache, serialized executables and profiles live
                  (default ~/.cache/qwen35_jax)
QWEN35_API_KEY    the server's --api-key default
QWEN35_COMMIT     the commit a profile report names when the tree has no git metadata (a copied checkout)
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID
                  JAX's own names for a multi-process job, the defaults of the serve flags of the same meaning
"""
from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class Environment:
    cache_root: str
    api_key: str | None
    commit: str | None
    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None


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
        commit=os.environ.get("QWEN35_COMMIT") or None,
        coordinator_address=os.environ.get("JAX_COORDINATOR_ADDRESS") or None,
        num_processes=_int("JAX_NUM_PROCESSES"),
        process_id=_int("JAX_PROCESS_ID"))


def cache_root() -> str:
    return read().cache_root

"""Test setup: 8 simulated CPU devices (tp up to 8), the HF fixtures, and the embedded tiny model."""
import os
import time

# Tests compile a few hundred small executables and run them on tiny models: LLVM at -O0 roughly halves XLA:CPU's
# compile time (measured: 4-6 s -> 2.5-3.5 s per engine executable) and makes the suite faster overall.
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
CASES = sorted(d for d in os.listdir(FIXTURES) if os.path.isdir(os.path.join(FIXTURES, d)))


def fixture_dir(name: str) -> str:
    return os.path.join(FIXTURES, name)


def reference(name: str) -> dict[str, np.ndarray]:
    return dict(np.load(os.path.join(FIXTURES, name, "reference.npz")))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from qwen35_jax.tools.make_tiny_model import make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny"))


# One persistent XLA cache for the whole run: engines built with the same shapes in different tests (or xdist
# workers) compile each executable once.
XLA_CACHE = os.environ.get("QWEN35_TEST_XLA_CACHE",
                           os.path.join(os.path.dirname(__file__), "..", ".cache", "xla-tests"))


def engine_args(**kw):
    base = dict(dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, max_prefill_rows=4,
                compilation_cache_dir=XLA_CACHE)
    base.update(kw)
    return base


def settled(engine):
    """engine's scheduler once every finished request's slot and pages are back: an idle engine returns them a
    moment after the requests' last outputs (Engine._loop), so a caller woken by an output may look before that."""
    deadline = time.monotonic() + 60
    while engine.scheduler.retired:
        assert time.monotonic() < deadline, "finished requests' resources were never returned"
        time.sleep(0.01)
    return engine.scheduler

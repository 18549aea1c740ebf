"""Device time per call, host dispatch excluded: the slope of a compiled program's time over two call counts."""
from __future__ import annotations

import time

import jax
import numpy as np


def slope_us(make_prog, args: tuple, calls: tuple[int, int], reps: int = 5, per_count: int = 1) -> float:
    """Microseconds per call. make_prog(c) is a function of *args making c * per_count calls back to back (each
    feeding the next, so none is hoisted or shared); it is compiled for both counts in `calls`, run once to warm
    up, then timed (median of reps); per call = time difference / call difference."""
    meds = []
    for c in calls:
        f = jax.jit(make_prog(c)).lower(*args).compile()
        jax.block_until_ready(f(*args))
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            ts.append(time.perf_counter() - t0)
        meds.append(float(np.median(ts)))
    return (meds[1] - meds[0]) / ((calls[1] - calls[0]) * per_count) * 1e6


def traced(run, sync, annotations=()):
    """The profiler's trace (qwen35_jax.tools.profile_trace.Trace) of run(): the device's kernel events (CUPTI sees
    torch's kernels too) and the host annotations named in `annotations`. sync(*outputs) waits for the device."""
    import tempfile

    from qwen35_jax.tools import profile_trace
    with tempfile.TemporaryDirectory() as d:
        sync()
        jax.profiler.start_trace(d)
        sync(run())
        jax.profiler.stop_trace()
        return profile_trace.load_trace(d, annotation_names=annotations)


def traced_events(run, sync):
    """The device's kernel events while run() runs under JAX's profiler."""
    return traced(run, sync).events


def traced_us(fn, args: tuple, calls: int = 16) -> tuple[float, dict[str, float]]:
    """Device time per call of jit(fn)(*args), read from a profiler trace: the sum of its kernels' times over
    `calls` runs, divided by `calls`; and the same per kernel name. Unlike slope_us nothing is chained to the
    call, so no elementwise op can fuse into its kernels and change XLA's choices."""
    f = jax.jit(fn).lower(*args).compile()
    jax.block_until_ready(f(*args))
    events = traced_events(lambda: [f(*args) for _ in range(calls)], lambda *out: jax.block_until_ready(out))
    kernels: dict[str, float] = {}
    for e in events:
        kernels[e.name] = kernels.get(e.name, 0.0) + e.self_ns / 1e3 / calls
    return sum(kernels.values()), kernels

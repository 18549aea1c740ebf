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

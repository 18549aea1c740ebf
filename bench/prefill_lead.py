"""Host marks of one-prompt requests: where the time from `generate` to the prefill's launch goes.

Wraps the engine's scheduler, executor and output steps with perf_counter marks (the first of each per request),
then runs --requests max_tokens=1 requests of --length random tokens on random weights at --config's shapes, the
prefix cache on (its snapshot copies compiled up front), and prints each request's marks in ms from the call of
`generate`: `schedule`, `copies` (the prefix cache's device copies dispatched in the plan), `rows` (laying out the
prefill's inputs), `call prefill` (until the launch returns), `device done` (the prefill's output ready: the
prefill is waited on here, so later marks are not the engine's own timing). The first request compiles.

    python bench/prefill_lead.py --config bench/configs/qwen3.5-9b.json --length 8192
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import random_engine  # noqa: E402
from qwen35_jax.engine import executor as ex  # noqa: E402
from qwen35_jax.engine import scheduler as sc  # noqa: E402
from qwen35_jax.engine.engine import Engine, EngineArgs  # noqa: E402
from qwen35_jax.engine.sampling_params import SamplingParams  # noqa: E402

MARKS: dict[str, float] = {}


def mark(name: str):
    MARKS.setdefault(name, time.perf_counter())


def wrap(owner, attr: str, name: str):
    f = getattr(owner, attr)

    def marked(*a, **k):
        mark(name + ">")
        out = f(*a, **k)
        mark(name + "<")
        return out
    setattr(owner, attr, marked)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--requests", type=int, default=7)
    args = ap.parse_args()
    engine = random_engine(args.config, EngineArgs(
        max_model_len=args.length + 16, max_num_seqs=1, max_num_batched_tokens=min(args.length, 8192),
        max_prefill_rows=1, precompile=False, enable_prefix_caching=True))
    engine.executor.precompile(progress=False, kinds=("save", "restore"))
    wrap(sc.Scheduler, "schedule", "schedule")
    wrap(ex.Executor, "_prefill_rows", "rows")
    wrap(ex.Executor, "run_copies", "copies")
    wrap(Engine, "_process", "process")
    call = ex.Executor._call

    def marked_call(self, key, exe, *a, **k):
        mark(f"call {key[0]}>")
        out = call(self, key, exe, *a, **k)
        mark(f"call {key[0]}<")
        if key[0] == "prefill":
            jax.block_until_ready(out)
            mark("device done")
        return out
    ex.Executor._call = marked_call
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    rng = np.random.default_rng(0)
    for i in range(args.requests):
        ids = rng.integers(0, engine.cfg.vocab_size, args.length).tolist()
        MARKS.clear()
        t0 = time.perf_counter()
        engine.generate([ids], [params])
        total = time.perf_counter() - t0
        rel = {k: round(1e3 * (v - t0), 3) for k, v in sorted(MARKS.items(), key=lambda kv: kv[1])}
        print(f"req {i}: total {1e3 * total:.2f} ms", rel, flush=True)
        time.sleep(0.2)
    engine.shutdown()


if __name__ == "__main__":
    main()

"""Decode step A/B: kernel configurations (KernelConfig fields) timed in one process, in alternating rounds.

Separate runs of bench/throughput.py or of the profile read the 9B batch-64 step ~0.1 ms apart for the same code
(bench/runs/history.md), as much as the changes under test. Here every variant gets its own engine (the same weights,
its own state and executables, keyed on its KernelConfig) and the decode steps of the variants are timed in
alternating rounds (the order reversed every other round), so drift of the machine falls on all of them alike.
Each round times each variant's steady-state step (the slope of back-to-back dispatches, as bench/throughput.py);
the report gives each variant's median over the rounds and the median of its per-round difference to the first.

    python bench/ab_decode.py --variants "" "gdn_decode.bv=32 gdn_decode.num_warps=2" --batches 16,64 --record
    python bench/ab_decode.py --variants "" "temperature=0.7"      # the greedy sampler vs the lean one
    python bench/ab_decode.py --variants "" "xla_options.xla_gpu_enable_pdl=false"   # XLA options
    python bench/ab_decode.py --config <tiny config.json> --kernel-backend pallas_interpret --batches 2 \
        --context 40 --rounds 2 --iters 2                                                       # CPU smoke run
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import results  # noqa: E402
from bench.common import add_kernel_args, kernel_config, random_engine  # noqa: E402
from bench.moe import distinct_tokens  # noqa: E402
from bench.throughput import Row  # noqa: E402
from qwen35_jax.model.backends import KernelConfig  # noqa: E402
from qwen35_jax.engine.engine import Engine, EngineArgs  # noqa: E402
from qwen35_jax.tools.profile import decode_rows, steady_step_seconds  # noqa: E402
from qwen35_jax.engine.sampler import host_batch  # noqa: E402
from qwen35_jax.engine.sampling_params import SamplingParams  # noqa: E402


def parse_variant(text: str, base: KernelConfig) -> tuple[KernelConfig, float]:
    """'gdn_decode.bv=32 temperature=0.7' -> (base with those KernelConfig fields, 0.7); '' is base itself.
    `temperature=T`: the rows sample at T with top_k 20 and top_p 0.8 (the lean sampler) instead of greedily."""
    items = text.split()
    temperature = float(next((i.split("=", 1)[1] for i in items if i.startswith("temperature=")), 0.0))
    return KernelConfig.parse(" ".join(i for i in items if not i.startswith("temperature=")), base), temperature


def decode_call(engine: Engine, batch: int, ctx: int, temperature: float = 0.0):
    """One decode step of `batch` live rows at context ctx (greedy, or sampled at `temperature` with top_k 20 and
    top_p 0.8), as bench/throughput.py dispatches it, in the engine's bucket for them (padding rows on the null
    slot past `batch`, as the engine pads; KernelConfig.decode_min_rows)."""
    ex = engine.executor
    b, slots, pages = decode_rows(ex, batch, engine.pages_per_seq)
    positions = np.where(slots > 0, ctx, 0).astype(np.int32)
    rows = [Row() for _ in range(batch)]
    if temperature > 0:
        for r in rows:
            r.params = SamplingParams(temperature=temperature, top_k=20, top_p=0.8)
    sp = host_batch(rows, b)
    return lambda: ex.decode(b, slots, positions, pages, sp)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="bench/configs/qwen3.5-9b.json")
    ap.add_argument("--variants", nargs="+", required=True,
                    help="space-separated KernelConfig field=value settings per variant ('' = the default build; "
                         "temperature=T samples); the first is the baseline")
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--context", type=int, default=1152)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20, help="steps in the shorter burst of a slope")
    add_kernel_args(ap)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()

    variants, temps = zip(*[parse_variant(v, kernel_config(args)) for v in args.variants])
    if len(variants) < 2:
        ap.error("--variants: at least two to compare")
    names = [" ".join(args.variants[i].split()) or "(default)" for i in range(len(variants))]
    batches = [int(b) for b in args.batches.split(",")]
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")   # 35B-A3B's ~68 GB beside a second engine
    eargs = EngineArgs(max_model_len=args.context + 64, max_num_seqs=max(batches), precompile=False,
                       max_num_batched_tokens=max(256, max(batches)), max_prefill_rows=1,
                       enable_prefix_caching=False, gpu_memory_utilization=0.98)   # room for more than one engine
    engines = [random_engine(args.config, dataclasses.replace(eargs, kernel_config=variants[0]))]
    engines += [random_engine(args.config, dataclasses.replace(eargs, kernel_config=v), weights=engines[0].weights)
                for v in variants[1:]]
    rows, failed = [], {}
    for b in batches:
        if engines[0].cfg.moe:          # rows of one token would all route alike
            for e in engines:
                distinct_tokens(e, b)
        calls = [decode_call(e, b, args.context, t) for e, t in zip(engines, temps)]
        t0 = time.perf_counter()
        for i, call in enumerate(calls):                # compile and warm up
            try:
                jax.block_until_ready([call() for _ in range(3)])
            except Exception as e:                      # reported; the variants that build are still compared
                if i == 0:
                    raise
                failed.setdefault(names[i], f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
                print(f"batch {b}: {names[i]} failed: {failed[names[i]]}", flush=True)
        keep = [i for i in range(len(calls)) if names[i] not in failed]
        print(f"batch {b}: {len(calls)} decode executables compiled and warm in {time.perf_counter() - t0:.1f}s",
              flush=True)
        steps = [[] for _ in calls]
        for r in range(args.rounds):
            order = keep if r % 2 == 0 else keep[::-1]  # no variant always first
            for i in order:
                def burst(k, call=calls[i]):
                    t = time.perf_counter()
                    for _ in range(k):
                        o = call()
                    jax.block_until_ready(o)
                    return time.perf_counter() - t
                steps[i].append(steady_step_seconds(burst, args.iters)[0])
            print(f"batch {b} round {r}: " + ", ".join(f"{steps[i][-1] * 1e3:.3f}" for i in keep), flush=True)
        for i in keep:
            name = names[i]
            diff = [a - z for a, z in zip(steps[i], steps[0])]
            rows.append({"batch": b, "variant": name, "step ms (median)": f"{statistics.median(steps[i]) * 1e3:.3f}",
                         "min / max ms": f"{min(steps[i]) * 1e3:.3f} / {max(steps[i]) * 1e3:.3f}",
                         "vs first, ms (median of rounds)": f"{statistics.median(diff) * 1e3:+.3f}",
                         "rounds faster": f"{sum(d < 0 for d in diff)} / {len(diff)}" if i else ""})
            print(rows[-1], flush=True)
    for e in engines:
        e.shutdown()
    body = (f"Model: `{args.config}` shapes, random bf16 weights, greedy decode (where no temperature is named) at "
            f"context {args.context}; one "
            f"engine per variant in one process, {args.rounds} alternating rounds, each a steady-state step (slope "
            f"of back-to-back dispatches from {args.iters} to {2 * args.iters} steps, median of 3 each).\n\n"
            + results.table(rows, list(rows[0]))
            + "".join(f"\nFailed to build or run: `{n}`: {e}\n" for n, e in failed.items()))
    if args.record:
        results.record("Decode step A/B (bench/ab_decode.py): " + " vs ".join(names), body)


if __name__ == "__main__":
    main()

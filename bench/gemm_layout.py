"""Decode matmul weight layout: the Pallas decode matmul on row-major [K, N] weights against the same kernel and
configuration on pre-tiled [N / bn, K, bn] weights (pallas_kernels/matmul.tile_weight), and XLA's dot, timed in
alternating rounds in one process.

The question it answers: a program's column block of a row-major weight is K row segments of bn * 2 bytes
(128 bytes at bn = 64), N * 2 bytes apart; a pre-tiled block is one contiguous slab. In the 9B decode step every
GEMM configuration tried moved the step by less than 0.03 ms (bench/RESULTS.md), as if the weights' read pattern,
not the tiles, set the GEMMs' pace at ~70-85% of the copy bandwidth. Same kernel, same configuration, only the
layout differs here.

    python bench/gemm_layout.py --record
    python bench/gemm_layout.py --interpret --scale 64 --rows 16 --rounds 1       # CPU smoke run
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import results  # noqa: E402
from bench.gemm import L2_BYTES, SHAPES  # noqa: E402
from bench.throughput import copy_bandwidth  # noqa: E402
from pallas_kernels import matmul as mm  # noqa: E402


def chained(fn, calls: int):
    """A program making `calls` passes over the weight copies, each call's output feeding the next call's input."""
    def prog(x, ws):
        for _ in range(calls):
            for w in ws:
                y = jax.lax.optimization_barrier(fn(x, w))
                x = x.at[:, 0].add((y[:, 0] * 1e-3).astype(x.dtype))
        return x
    return prog


def seconds(f, args, reps: int) -> float:
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="mlp gate_up,mlp down_proj,gdn in_proj,out_proj / o_proj")
    ap.add_argument("--rows", default="64,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--scale", type=int, default=1, help="divide K and N (CPU smoke runs)")
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    bw = None if args.interpret else copy_bandwidth()
    calls = (1, 3)
    lines = []
    for name in args.shapes.split(","):
        k, n = (d // args.scale for d in SHAPES[name])
        copies = 1 if args.interpret else max(2, -(-L2_BYTES // (k * n * 2)))
        ws = tuple((0.02 * jax.random.normal(jax.random.key(i), (k, n), jnp.float32)).astype(jnp.bfloat16)
                   for i in range(copies))
        for m in (int(r) for r in args.rows.split(",")):
            config = mm.choose(m, k, n)
            if config is None:
                print(f"{name} {m} rows: no Pallas configuration fits; skipped")
                continue
            tiled = tuple(mm.tile_weight(w, config.bn) for w in ws)
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
            pallas = lambda x, w: mm.matmul(x, w, config=config, interpret=args.interpret)
            want = mm.reference(x, ws[0], out_dtype=jnp.float32)
            for w in (ws[0], tiled[0]):
                got = mm.matmul(x, w, out_dtype=jnp.float32, config=config, interpret=args.interpret)
                err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
                if err > 1e-3:
                    raise SystemExit(f"{name} {m} rows {w.shape}: max error {err:.1e} against XLA's dot")
            variants = {"XLA dot": (lambda x, w: mm.reference(x, w), ws), "Pallas [K, N]": (pallas, ws),
                        "Pallas tiled": (pallas, tiled)}
            progs = {v: [jax.jit(chained(fn, c)).lower(x, w).compile() for c in calls]
                     for v, (fn, w) in variants.items()}
            per_call = {v: [] for v in variants}
            for r in range(args.rounds):
                order = list(variants) if r % 2 == 0 else list(variants)[::-1]
                for v in order:
                    a, b = (seconds(p, (x, variants[v][1]), args.reps) for p in progs[v])
                    per_call[v].append((b - a) / ((calls[1] - calls[0]) * copies))
            us = {v: statistics.median(t) * 1e6 for v, t in per_call.items()}
            frac = (lambda t: f"{k * n * 2 / (t * 1e-6) / bw:.2f}") if bw else (lambda t: "-")
            lines.append(f"| {name} | {k}x{n} | {m} | {config.name} | " + " | ".join(
                f"{us[v]:.1f} ({frac(us[v])})" for v in variants) + f" | {us['Pallas [K, N]'] / us['Pallas tiled']:.2f}× |")
            print(lines[-1], flush=True)
    head = "| matmul | K x N | rows | configuration | XLA dot us (x bw) | Pallas [K, N] us (x bw) | Pallas tiled us (x bw) | [K, N] / tiled |"
    body = ((f"Copy bandwidth in this run {bw / 1e12:.2f} TB/s; " if bw else "")
            + f"median of {args.rounds} alternating rounds, each the slope of a program's time from {calls[0]} to "
            f"{calls[1]} passes over weight copies that together exceed the L2 (median of {args.reps} runs each). "
            "'x bw': weight bytes read per second over the copy bandwidth.\n\n"
            + head + "\n" + "|---" * (head.count("|") - 1) + "|\n" + "\n".join(lines) + "\n")
    print(body)
    if args.record:
        results.record("Decode matmul weight layout: row-major vs pre-tiled (bench/gemm_layout.py)", body)


if __name__ == "__main__":
    main()

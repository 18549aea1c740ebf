"""Paged decode attention on the GPU: the Pallas kernel's variants against the jnp reference, side by side.

At 9B shapes (Hq 16, Hkv 4, D 256, page 16, bf16 KV): checks every variant against the reference on the GPU, then
times each at batch 1, 16, 64 and contexts 1k and 8k, and reports the KV bytes read per second against the copy
bandwidth measured in the same run.

    python bench/attention.py --record
    python bench/attention.py --interpret --batches 2 --contexts 64     # CPU smoke run of the script itself

GPU time, host dispatch excluded: a compiled program makes R calls back to back (a loop with a static trip count,
so XLA runs it without a host round trip; each call's output feeds the next query so nothing is dead code), for
two values of R; time per call = slope.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import results  # noqa: E402
from bench.throughput import copy_bandwidth  # noqa: E402
from bench.timing import slope_us  # noqa: E402
from bench.kernel_sweeps import attention_sweep  # noqa: E402
from pallas_kernels import paged_attention as pa  # noqa: E402
from qwen35_jax.model.attention import decode_attention  # noqa: E402

HQ, HKV, D, PAGE = 16, 4, 256, 16


def inputs(batch, ctx, seed=0):
    pages_per_seq = -(-ctx // PAGE)
    num_pages = 1 + batch * pages_per_seq
    ks = jax.random.split(jax.random.key(seed), 3)
    k = jax.random.normal(ks[0], (HKV, num_pages, PAGE, D), jnp.bfloat16)
    v = jax.random.normal(ks[1], (HKV, num_pages, PAGE, D), jnp.bfloat16)
    q = jax.random.normal(ks[2], (batch, HQ, D), jnp.bfloat16)
    pages = (1 + np.random.default_rng(seed).permutation(batch * pages_per_seq)).reshape(batch, pages_per_seq)
    return q, k, v, jnp.asarray(pages, jnp.int32), jnp.full((batch,), ctx, jnp.int32)


def per_call_us(fn, args, calls=(8, 40), reps=5):
    def make_prog(r):
        def prog(q, k, v, pages, ctx):
            def body(_, q):
                return (q + 1e-3 * fn(q, k, v, pages, ctx)).astype(q.dtype)
            return jax.lax.fori_loop(0, r, body, q)
        return prog
    return slope_us(make_prog, args, calls, reps)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--interpret", action="store_true", help="kernels in interpret mode (CPU smoke run of this script)")
    ap.add_argument("--pick", default=None, metavar="FILE",
                    help="write the variant with the least total time over the timed cells of the smallest context "
                         "(the decode contexts the engine benchmarks run) to FILE, as KernelConfig fields")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    variants = {c.name: jax.jit(lambda *a, c=c: pa.paged_decode_attention(*a, config=c, interpret=args.interpret))
                for c in attention_sweep()}
    ref = jax.jit(decode_attention)

    checks, ok = [], []
    x = inputs(5, 700, seed=1)
    want = np.asarray(ref(*x), np.float32)
    for name, fn in variants.items():
        try:
            got = np.asarray(fn(*x), np.float32)
            err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            good = bool(np.isfinite(got).all() and err < 1e-2)
        except Exception as e:  # noqa: BLE001 - a variant that fails to compile is reported, not fatal
            err, good = repr(e)[:200], False
        checks.append({"variant": name, "rel-L2 vs reference": f"{err:.2e}" if isinstance(err, float) else err,
                       "ok": good})
        if good:
            ok.append(name)
        print(checks[-1], flush=True)

    rows = []
    for ctx in [int(c) for c in args.contexts.split(",")]:
        for b in [int(v) for v in args.batches.split(",")]:
            x = inputs(b, ctx)
            kv_bytes = 2 * b * ctx * HKV * D * 2
            row = {"batch": b, "context": ctx, "KV MB": f"{kv_bytes / 1e6:.1f}"}
            t_ref = per_call_us(ref, x)
            row["reference us"] = f"{t_ref:.1f}"
            best = None
            for name in ok:
                t = per_call_us(variants[name], x)
                row[f"{name} us"] = f"{t:.1f}"
                best = min(best or (t, name), (t, name))
            if best:
                row["best"] = best[1]
                row["best / copy bw"] = f"{kv_bytes / (best[0] * 1e-6) / bw:.2f}"
                row["reference / best"] = f"{t_ref / best[0]:.2f}×"
            rows.append(row)
            print(row, flush=True)

    if args.pick and ok:
        ctx0 = min(r["context"] for r in rows)
        total = {nm: sum(float(r[f"{nm} us"]) for r in rows if r["context"] == ctx0) for nm in ok}
        best = min(total, key=total.get)
        config = next(c for c in attention_sweep() if c.name == best)       # as KernelConfig fields
        open(args.pick, "w").write(" ".join(f"decode_attention.{k}={v}" for k, v in dataclasses.asdict(config).items()))
        print(f"picked {best}: {total[best]:.1f} us over the context-{ctx0} cells (default {pa.DEFAULT.name}: "
              f"{total.get(pa.DEFAULT.name, float('nan')):.1f} us)", flush=True)
    body = (f"9B attention shapes (Hq {HQ}, Hkv {HKV}, D {D}, page {PAGE}, bf16 KV). Copy bandwidth in this run "
            f"{bw / 1e12:.2f} TB/s. 'best / copy bw': KV bytes read per second by the fastest variant over the copy "
            "bandwidth. GPU correctness (5 rows, context 700, against the jnp reference):\n\n"
            + results.table(checks, list(checks[0])) + "\n\nTimes per call (µs):\n\n"
            + results.table(rows, list(dict.fromkeys(k for r in rows for k in r))))
    if args.record:
        results.record("Paged decode attention (bench/attention.py)", body)


if __name__ == "__main__":
    main()

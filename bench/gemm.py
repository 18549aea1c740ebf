"""Decode-shaped matmuls on the GPU: the Pallas kernels' configurations against XLA's dot.

    python bench/gemm.py --record [--pick picks.json]
    python bench/gemm.py --interpret --rows 2 --scale 64          # CPU smoke run of the script itself

At the 9B decode projections (K x N of in_proj, qkv_proj, out_proj / o_proj, gate_up, down_proj, lm_head) and
M = 1, 16, 64 rows: the Pallas-Triton kernel's configurations (pallas_kernels/matmul.py: config_sweep()) and
the Mosaic GPU kernel's (pallas_kernels/matmul_mgpu.py: what each of its RULES picks for the shape); checks every
configuration against XLA's dot, then times each and reports the weight bytes
read per second against the copy bandwidth measured in the same run. XLA's dot runs twice: on the weight as the
model stores it ([K, N]) and on its transpose ([N, K], the checkpoint's and PyTorch's layout, where each output
column's K values are contiguous), and a pass that only reads the weight (a sum of all its entries, scaled by an
entry of x so that no pass can be shared): what a GEMM of these rows could reach if reading the weight were all
it did. GPU time, host dispatch excluded: a
program makes many calls back to back over copies of the weight that together exceed the L2 (see per_call_us);
per call = slope over two call counts. --pick writes the fastest configuration per (shape, rows) as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import results  # noqa: E402
from bench.throughput import copy_bandwidth  # noqa: E402
from bench.timing import slope_us  # noqa: E402
from pallas_kernels import matmul as mm  # noqa: E402
from pallas_kernels import matmul_mgpu as mg  # noqa: E402

SHAPES = {"gdn in_proj": (4096, 12352), "attn qkv_proj": (4096, 10240), "out_proj / o_proj": (4096, 4096),
          "mlp gate_up": (4096, 24576), "mlp down_proj": (12288, 4096), "lm_head": (4096, 248320)}


L2_BYTES = 200 * 2**20      # weight copies cycled per program exceed this (the H200's L2 holds 50 MB)


def per_call_us(fn, x, ws, calls=(1, 4), reps=7):
    """GPU time of one call: straight-line programs making c * len(ws) calls (cycling the weight copies, so none
    is read from L2; each call's output, behind an optimization barrier, feeds one element of the next call's
    input), for two c; per call = slope."""
    def make_prog(c):
        def prog(x, ws):
            for _ in range(c):
                for w in ws:
                    y = jax.lax.optimization_barrier(fn(x, w))
                    x = x.at[:, 0].add((y[:, 0] * 1e-3).astype(x.dtype))
            return x
        return prog
    return slope_us(make_prog, (x, ws), calls, reps, per_count=len(ws))


def read_only(x, w):
    """Reads every entry of w once (their sum, times an entry of x so that no two passes are the same computation):
    the weight's read time alone, for x's rows as a [M, 1] column."""
    s = jnp.sum(w.astype(jnp.float32) * x[0, 0].astype(jnp.float32))
    return jnp.full((x.shape[0], 1), s, x.dtype)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of SHAPES")
    ap.add_argument("--scale", type=int, default=1, help="divide K and N (CPU smoke runs)")
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--xla-only", action="store_true", help="time XLA's dot alone (both weight layouts)")
    ap.add_argument("--pick", help="write the fastest configuration per (K x N, rows) here (JSON)")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    bw = None if args.interpret else copy_bandwidth()
    configs = [] if args.xla_only else mm.config_sweep()
    lines, picks, checks, failed = [], {}, [], {}
    for name in args.shapes.split(","):
        k, n = (d // args.scale for d in SHAPES[name])
        copies = 1 if args.interpret else max(1, -(-L2_BYTES // (k * n * 2)))
        ws = tuple((jax.random.normal(jax.random.key(i), (k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
                   for i in range(copies))
        w = ws[0]
        wts = tuple(jnp.asarray(v.T) for v in ws)                  # [N, K] copies
        nk = lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
                                              ).astype(x.dtype)
        for m in rows:
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
            ref = mm.reference(x, w, out_dtype=jnp.float32)
            err = float(jnp.max(jnp.abs(nk(x, wts[0]).astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
            if err > 1e-2:
                raise SystemExit(f"[N, K] dot at {m}x{k}x{n}: max error {err:.2e} against XLA's dot")
            row = {"XLA dot": per_call_us(lambda x, w: mm.reference(x, w), x, ws)}
            t_nk = per_call_us(nk, x, wts)
            t_read = per_call_us(read_only, x, ws)
            mgpu = [] if args.xla_only else sorted(
                {c for kw in mg.RULES.values() if (c := mg.choose(m, k, n, **kw))}, key=str)
            for c in configs + mgpu:
                lib = mg if isinstance(c, mg.MgpuConfig) else mm
                if not lib.fits(m, k, n, c):
                    continue
                f = lambda x, w, c=c, lib=lib: lib.matmul(x, w, out_dtype=jnp.float32, config=c,
                                                          interpret=args.interpret)
                try:
                    err = float(jnp.max(jnp.abs(f(x, w) - ref)) / jnp.max(jnp.abs(ref)))
                except Exception as e:         # a kernel that does not build: reported, the others still timed
                    failed.setdefault(c.name, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
                    print(f"   {c.name} at {m}x{k}x{n} failed: {failed[c.name]}", flush=True)
                    continue
                if err > 1e-3:                 # wrong results: reported, never timed
                    failed.setdefault(c.name, f"max error {err:.2e} against XLA's dot at {m}x{k}x{n}")
                    print(f"   {c.name} at {m}x{k}x{n}: max error {err:.2e} against XLA's dot", flush=True)
                    continue
                checks.append(err)
                row[c.name] = per_call_us(lambda x, w, c=c, lib=lib: lib.matmul(x, w, config=c,
                                                                                interpret=args.interpret), x, ws)
            frac = (lambda t: f"{k * n * 2 / (t * 1e-6) / bw:.2f}") if bw else (lambda t: "-")
            cells = (f"| {name} | {k}x{n} | {m} | {row['XLA dot']:.1f} | {frac(row['XLA dot'])} | {t_nk:.1f} | "
                     f"{frac(t_nk)} | {t_read:.1f} | {frac(t_read)} |")
            timed = [(t, c) for c, t in row.items() if c != "XLA dot"]
            if configs and not timed:          # no configuration fits this shape
                cells += " — | — | — | — | — |"
            elif configs:
                best = min(timed)
                picks.setdefault(f"{k}x{n}", {})[m] = best[1]
                cells += (f" {best[1]} | {best[0]:.1f} | {frac(best[0])} | {row['XLA dot'] / best[0]:.2f}× | "
                          f"{row[configs[0].name]:.1f} |")
            lines.append(cells)
            print(lines[-1], flush=True)
            print("   " + "  ".join(f"{c}={t:.1f}" for c, t in row.items()), flush=True)
    head = "| matmul | K x N | rows | XLA us | XLA x bw | XLA [N, K] us | x bw | read only us | x bw |"
    if configs:
        head += " best Pallas | us | x bw | XLA / best | default us |"
    body = ((f"Copy bandwidth in this run {bw / 1e12:.2f} TB/s. " if bw else "")
            + (f"{len(configs)} Pallas-Triton configurations and the Mosaic GPU kernel's picks per shape (mg_*), "
               f"every one checked against XLA's dot (max error relative to the largest output "
               f"{max(checks, default=0):.1e}). " if configs else "")
            + "'x bw': weight bytes read per second over the copy bandwidth. 'XLA [N, K]': XLA's dot on the "
            "transposed weight. 'read only': a pass that reads the weight and does nothing else (its sum).\n\n"
            + head + "\n" + "|---" * (head.count("|") - 1) + "|\n" + "\n".join(lines) + "\n"
            + "".join(f"\nFailed to build or run: `{c}`: {e}\n" for c, e in failed.items()))
    print(body)
    if args.pick:
        with open(args.pick, "w") as f:
            json.dump(picks, f, indent=1)
    if args.record:
        flags = os.environ.get("XLA_FLAGS", "")
        results.record("Decode matmuls: Pallas vs XLA (bench/gemm.py)" + (f" XLA_FLAGS={flags}" if flags else "")
                       + (" (XLA only)" if args.xla_only else ""), body)


if __name__ == "__main__":
    main()

"""Decode projections by weight layout: w stored [K, N] (the product's, x @ w) against [N, K] (HF's nn.Linear
layout, x @ w.T), through XLA's dot and through a GEMV kernel for each layout, at a few decode row counts.

Why: in the 35B-A3B batch-1 profile XLA's two-row GEMMs read in_proj at ~2.2 TB/s and qkv at ~1.9, against a copy
rate of ~3.0 (bench/RESULTS.md), and the GEMV kernel over [K, N] tiles did no better (bench/gemv.py). A program
reading a [K, N] column tile fetches 128-byte pieces of rows 2N bytes apart; over [N, K] it streams whole rows.
Each form runs over `copies` distinct weight arrays per call (at least --min-mib in all), so no call reads its
weights from L2; the time per dot is the call's kernel time (profiler trace) over copies, rounding included.

    python bench/gemm_layout.py --record
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as pltriton  # noqa: E402

from bench import results  # noqa: E402
from bench.timing import traced_us  # noqa: E402
from pallas_kernels import gemv as gemv_kernel  # noqa: E402

# name: (K, N, fp32 out (row-parallel))
SHAPES = {"35b_in_proj": (2048, 12352, False), "35b_qkv": (2048, 9216, False), "35b_out_proj": (4096, 2048, True),
          "35b_expert_gate_up": (2048, 1024, False), "9b_in_proj": (4096, 12352, False),
          "9b_qkv": (4096, 10240, False), "9b_out_proj": (4096, 4096, True), "9b_gate_up": (4096, 24576, False),
          "9b_down": (12288, 4096, True)}


def _nk_kernel(x_ref, w_ref, o_ref, *, block_k):
    """Program j: rows [j BN, (j+1) BN) of w [N, K] (whole) against x [16, K] (zero rows past M): o [16, BN]."""
    j = pl.program_id(0)
    bn = o_ref.shape[1]

    def body(i, acc):
        wk = pltriton.load(w_ref.at[pl.ds(j * bn, bn), pl.ds(i * block_k, block_k)], eviction_policy="evict_first")
        return acc + pltriton.dot(x_ref[:, pl.ds(i * block_k, block_k)], wk, trans_b=True)

    acc = jax.lax.fori_loop(0, w_ref.shape[1] // block_k, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def gemv_nk(x, wt, out_dtype, *, block_n=32, block_k=256, num_warps=4, num_stages=3, interpret=False):
    """x [M <= 16, K] @ wt.T, wt [N, K]: one program per block_n rows of wt, streaming them whole (no K split)."""
    m, kdim = x.shape
    n = wt.shape[0]
    xp = jnp.zeros((16, kdim), x.dtype).at[:m].set(x)
    out = pl.pallas_call(
        functools.partial(_nk_kernel, block_k=block_k), grid=(n // block_n,),
        in_specs=[pl.BlockSpec(xp.shape, lambda j: (0, 0)), pl.BlockSpec(wt.shape, lambda j: (0, 0))],
        out_specs=pl.BlockSpec((16, block_n), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((16, n), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages), name="gemv_nk",
        interpret=interpret,
    )(xp, wt)
    return out[:m]


def forms(out_dtype, interpret):
    """name -> (layout, f(x [M, K], w in that layout) -> [M, N] out_dtype, most rows)."""
    f32 = jnp.float32
    nk = lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=f32)
    return {
        "xla_kn": ("kn", lambda x, w: jnp.dot(x, w, preferred_element_type=f32).astype(out_dtype), 1 << 30),
        "xla_nk": ("nk", lambda x, w: nk(x, w).astype(out_dtype), 1 << 30),
        "gemv_kn": ("kn", functools.partial(gemv_kernel.gemv, out_dtype=out_dtype, interpret=interpret), 16),
        **{f"gemv_nk_n{bn}_k{bk}": ("nk", functools.partial(gemv_nk, out_dtype=out_dtype, block_n=bn, block_k=bk,
                                                        interpret=interpret), 16)
           for bn, bk in ((32, 256), (64, 128), (16, 512))},
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="names of SHAPES, or KxN (bf16 out)")
    ap.add_argument("--rows", default="2,16,64", help="decode rows M")
    ap.add_argument("--min-mib", type=int, default=384, help="weights read per call, at least (L2: 50 MB)")
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    interpret = jax.default_backend() != "gpu"
    rows, names = [], None
    for name in args.shapes.split(","):
        kdim, n, fp32 = SHAPES[name] if name in SHAPES else (*(int(d) for d in name.split("x")), False)
        out_dtype = jnp.float32 if fp32 else jnp.bfloat16
        copies = max(2, -(-(args.min_mib << 20) // (kdim * n * 2)))
        keys = jax.random.split(jax.random.key(0), copies + 1)
        ws = [(0.02 * jax.random.normal(kk, (kdim, n), jnp.float32)).astype(jnp.bfloat16) for kk in keys[1:]]
        wts = [jnp.asarray(w.T) for w in ws]
        fs = forms(out_dtype, interpret)
        names = list(fs)
        for m in (int(r) for r in args.rows.split(",")):
            x = jax.random.normal(keys[0], (m, kdim), jnp.float32).astype(jnp.bfloat16)
            want = fs["xla_kn"][1](x, ws[0]).astype(jnp.float32)
            row = {"shape": f"{name} [{kdim}, {n}]{' f32' if fp32 else ''}", "rows": m, "copies": copies,
                   "bytes": kdim * n * 2}
            for form, (layout, f, most) in fs.items():
                if m > most:
                    continue
                w_in = ws if layout == "kn" else wts
                err = float(jnp.max(jnp.abs(f(x, w_in[0]).astype(jnp.float32) - want)))
                us, kernels = traced_us(lambda x, w, f=f: tuple(f(x, wi) for wi in w), (x, tuple(w_in)), args.calls)
                us /= copies
                row[form] = us
                print(json.dumps({"shape": name, "rows": m, "form": form, "us": round(us, 2),
                                  "tb_per_s": round(kdim * n * 2 / us / 1e6, 3), "max_abs_err": err,
                                  "kernels": {k: round(v / copies, 2) for k, v in kernels.items()}}), flush=True)
            rows.append(row)
    table = [{"shape": r["shape"], "rows": r["rows"],
              **{f: f"{r[f]:.1f} ({r['bytes'] / r[f] / 1e6:.2f})" if f in r else "" for f in names}} for r in rows]
    body = ("Device time per dot, us (TB/s of weights in brackets): kernel time from a profiler trace over "
            f"{args.calls} calls, each over distinct weight copies (>= {args.min_mib} MiB per call, no L2 reuse). "
            "xla_kn: x @ w, w [K, N] (the product's layout; fp32 accumulation, rounded after); xla_nk: the same "
            "with w stored [N, K]; gemv_kn: pallas_kernels.gemv (default tiles, row pad and K-split sums "
            "included); gemv_nk_nBN_kBK: a GEMV over [N, K], block_n rows of w per program, whole K.\n\n"
            + results.table(table, ["shape", "rows", *names]))
    print(body)
    if args.record:
        results.record("Decode GEMMs by weight layout (bench/gemm_layout.py)", body, fields={"rows": rows})


if __name__ == "__main__":
    main()

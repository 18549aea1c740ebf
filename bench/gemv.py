"""Decode projections at batch 1: XLA's GEMM (as forward.project runs it) against a Pallas-Triton GEMV sweep.

XLA picked 8 x 16 output tiles with 2 warps for the 9B GDN in_proj and attention qkv at batch 1 (their
bf16-rounding fusions), which read at ~60-64% of the copy bandwidth where gate_up's 8 x 128 tiles read at ~88%
(the 2026-12-06 profiles, bench/RESULTS.md). This times, per projection shape, forward.project and a GEMV kernel
(the row padded to Triton's 16-row dot, one program per column tile and K split, fp32 partial sums added and
rounded after) over a few tiles, each as device time per call; an experiment, not a product kernel.

    python bench/gemv.py --record
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
from bench.timing import slope_us  # noqa: E402
from qwen35_jax.model.forward import project  # noqa: E402

SHAPES = {"9b_in_proj": (4096, 12352), "9b_qkv": (4096, 10240), "9b_out_proj": (4096, 4096),
          "35b_in_proj": (2048, 12352), "9b_gate_up": (4096, 24576)}
TILES = [(bn, bk, split, stages) for bn in (32, 64, 128) for bk in (128, 256) for split in (1, 2) for stages in (3,)]


def _kernel(x_ref, w_ref, o_ref, *, block_k, steps):
    j, s = pl.program_id(0), pl.program_id(1)
    bn = o_ref.shape[-1]

    def body(i, acc):
        k = pl.ds((s * steps + i) * block_k, block_k)
        return acc + pltriton.dot(x_ref[:, k], w_ref[k, pl.ds(j * bn, bn)])

    o_ref[...] = jax.lax.fori_loop(0, steps, body, jnp.zeros(o_ref.shape, jnp.float32))


def gemv(x, w, *, bn, bk, split, stages, warps=4, interpret=False):
    """x [M <= 16, K] @ w [K, N] -> [M, N] in x.dtype, fp32 accumulation rounded once."""
    m, kdim = x.shape
    n = w.shape[1]
    xp = jnp.zeros((16, kdim), x.dtype).at[:m].set(x)
    part = pl.pallas_call(
        functools.partial(_kernel, block_k=bk, steps=kdim // split // bk), grid=(n // bn, split),
        in_specs=[pl.BlockSpec((16, kdim), lambda j, s: (0, 0)), pl.BlockSpec((kdim, n), lambda j, s: (0, 0))],
        out_specs=pl.BlockSpec((None, 16, bn), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((split, 16, n), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages), interpret=interpret,
    )(xp, w)
    return part.sum(0)[:m].astype(x.dtype)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="names of SHAPES, or KxN")
    ap.add_argument("--calls", default="4,16")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    interpret = jax.default_backend() != "gpu"
    calls = tuple(int(c) for c in args.calls.split(","))
    rows = []
    for name in args.shapes.split(","):
        kdim, n = SHAPES[name] if name in SHAPES else (int(d) for d in name.split("x"))
        ks = jax.random.split(jax.random.key(0), 2)
        x = jax.random.normal(ks[0], (1, kdim), jnp.float32).astype(jnp.bfloat16)
        w = (0.02 * jax.random.normal(ks[1], (kdim, n), jnp.float32)).astype(jnp.bfloat16)
        forms = {"xla_project": lambda x, w: project(x[None], w)[0]}
        for bn, bk, split, stages in TILES:
            if n % bn == 0 and kdim % (split * bk) == 0:
                forms[f"n{bn}_k{bk}_s{split}_st{stages}"] = functools.partial(
                    gemv, bn=bn, bk=bk, split=split, stages=stages, interpret=interpret)
        want = forms["xla_project"](x, w).astype(jnp.float32)
        row = {"shape": f"{name} [{kdim}, {n}]", "mb": kdim * n * 2 / 1e6}
        for form, f in forms.items():
            try:
                err = float(jnp.max(jnp.abs(f(x, w).astype(jnp.float32) - want)))
            except Exception as e:          # a tile Triton cannot take: reported, the others still timed
                print(json.dumps({"shape": name, "form": form, "failed": f"{type(e).__name__}: {str(e)[:200]}"}))
                continue

            def make(c, f=f):
                def prog(x, w):
                    acc = jnp.zeros((1, n), jnp.float32)
                    for _ in range(c):       # each call's row depends on the last one's output
                        acc = acc + f(x + (acc[:, :1] * 0).astype(x.dtype), w).astype(jnp.float32)
                    return acc
                return prog

            us = slope_us(make, (x, w), calls)
            row[form] = us
            print(json.dumps({"shape": name, "form": form, "us": round(us, 2),
                              "tb_per_s": round(kdim * n * 2 / us / 1e6, 3), "max_abs_err": err}), flush=True)
        rows.append(row)
    forms = sorted({k for r in rows for k in r} - {"shape", "mb"}, key=lambda k: (k != "xla_project", k))
    table = [{"shape": r["shape"], **{f: f"{r[f]:.1f}" if f in r else "" for f in forms}} for r in rows]
    body = ("Device time per call, us (slope over %d and %d calls in one program), one bf16 row. xla_project: "
            "forward.project; nBN_kBK_sS_stT: the GEMV's column tile, K step, K splits, pipeline stages.\n\n"
            % calls + results.table(table, ["shape", *forms]))
    print(body)
    if args.record:
        results.record("Decode GEMV sweep (bench/gemv.py)", body, fields={"rows": rows})


if __name__ == "__main__":
    main()

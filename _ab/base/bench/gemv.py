"""Decode projections at batch 1: XLA's GEMM (as forward.project runs it) against the GEMV kernel's tiles.

Per projection shape of the 9B, 27B and 35B-A3B (column-parallel ones rounded to bf16, row-parallel ones in fp32
as row_parallel asks), the device time per call read from a profiler trace (bench.timing.traced_us: nothing is
chained to the call, so no elementwise op fuses into XLA's GEMM and changes its tiles), for forward.project and
pallas_kernels.gemv over a few GemvConfig tiles. The traced time includes the kernel's row pad and the sum of its
K splits, as separate kernels; in the model XLA fuses them into the norm before and the consumer after.

    python bench/gemv.py --record
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench import results  # noqa: E402
from bench.timing import traced_us  # noqa: E402
from pallas_kernels import gemv as gemv_kernel  # noqa: E402
from qwen35_jax.model.forward import project  # noqa: E402

# name: (K, N, out fp32 (row-parallel))
SHAPES = {"9b_in_proj": (4096, 12352, False), "35b_in_proj": (2048, 12352, False), "9b_qkv": (4096, 10240, False),
          "35b_qkv": (2048, 9216, False), "9b_out_proj": (4096, 4096, True), "35b_out_proj": (4096, 2048, True),
          "27b_in_proj": (5120, 16432, False), "9b_gate_up": (4096, 24576, True), "9b_down": (12288, 4096, True),
          "27b_out_proj": (6144, 5120, True)}
TILES = ("n32_k256_p264", "n64_k128_p264", "n64_k256_p264", "n64_k256_p132", "n128_k128_p264", "n128_k256_p264")


def tile_config(name: str) -> gemv_kernel.GemvConfig:
    """'n64_k128_p264' (block_n, block_k, min_programs), optionally '_w8' (warps) and '_s4' (pipeline stages)."""
    keys = {"n": "block_n", "k": "block_k", "p": "min_programs", "w": "num_warps", "s": "num_stages"}
    return dataclasses.replace(gemv_kernel.DEFAULT, **{keys[p[0]]: int(p[1:]) for p in name.split("_")})

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="names of SHAPES, or KxN (bf16 out)")
    ap.add_argument("--tiles", default=",".join(TILES), help="GEMV tiles: nN_kK_pP[_wW][_sS] (tile_config)")
    ap.add_argument("--calls", type=int, default=16)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    interpret = jax.default_backend() != "gpu"
    rows = []
    for name in args.shapes.split(","):
        kdim, n, fp32 = SHAPES[name] if name in SHAPES else (*(int(d) for d in name.split("x")), False)
        out_dtype = jnp.float32 if fp32 else jnp.bfloat16
        ks = jax.random.split(jax.random.key(0), 2)
        x = jax.random.normal(ks[0], (1, kdim), jnp.float32).astype(jnp.bfloat16)
        w = (0.02 * jax.random.normal(ks[1], (kdim, n), jnp.float32)).astype(jnp.bfloat16)
        forms = {"xla_project": lambda x, w: project(x[None], w, out_dtype)[0]}
        for tile in args.tiles.split(","):
            config = tile_config(tile)
            forms[tile] = functools.partial(gemv_kernel.gemv, out_dtype=out_dtype, config=config,
                                            interpret=interpret)
        want = forms["xla_project"](x, w).astype(jnp.float32)
        row = {"shape": f"{name} [{kdim}, {n}]{' f32' if fp32 else ''}"}
        for form, f in forms.items():
            err = float(jnp.max(jnp.abs(f(x, w).astype(jnp.float32) - want)))
            us, kernels = traced_us(f, (x, w), args.calls)
            row[form] = us
            print(json.dumps({"shape": name, "form": form, "us": round(us, 2),
                              "tb_per_s": round(kdim * n * 2 / us / 1e6, 3), "max_abs_err": err,
                              "kernels": {k: round(v, 2) for k, v in kernels.items()}}), flush=True)
        best = min((f for f in forms if f != "xla_project"), key=lambda f: row[f])
        row["best"] = f"{best} ({row['xla_project'] / row[best]:.2f}x)"
        rows.append(row)
    forms = ["xla_project", *args.tiles.split(",")]
    table = [{"shape": r["shape"], **{f: f"{r[f]:.1f}" for f in forms}, "best": r["best"]} for r in rows]
    body = (f"Device time per call, us (kernel time from a profiler trace, {args.calls} calls), one bf16 row. "
            "xla_project: forward.project; nN_kK_pP[_wW][_sS]: the GEMV kernel's block_n, block_k, min_programs "
            "(warps, stages; row pad and split sums included); best: the fastest tile and XLA's time over its.\n\n"
            + results.table(table, ["shape", *forms, "best"]))
    print(body)
    if args.record:
        results.record("Decode GEMV sweep (bench/gemv.py)", body, fields={"rows": rows})


if __name__ == "__main__":
    main()

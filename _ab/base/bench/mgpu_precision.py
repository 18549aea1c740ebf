"""Errors of the GDN prefill's configurations against the fp32 token scan, on the CPU (interpret mode; Mosaic GPU's
interpreter for the Mosaic scan): bf16 inputs with tests/test_kernels.py's realistic gates, 2 key / 4 value heads,
dk 64, dv 128.

    python bench/mgpu_precision.py --lens 2048,0 --configs "" mgpu=false prep_mode=solve2

Sequences are padded to the longest, which must be a multiple of 8 for the Mosaic scan (its aligned starts). Each
config is a list of gdn.PrefillConfig overrides (k=v: integers, true / false or strings) on the default. Prints o and
final-state rel-L2 per configuration (no GPU figure: timing is bench/prefill_parts.py's)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from pallas_kernels import gdn, gdn_reference  # noqa: E402
from test_kernels import _prefill_fn, gdn_inputs, rel  # noqa: E402


def overrides(spec):
    kw = dict(x.split("=") for x in spec.split(",") if x)
    value = lambda v: int(v) if v.isdigit() else {"true": True, "false": False}.get(v.lower(), v)
    return {k: value(v) for k, v in kw.items()}


def errors(config, lens_l, seed=13, dk=64, dv=128):
    n, t = len(lens_l), max(lens_l)
    q, k, v, a, b, A_log, dt_bias, pool = gdn_inputs(seed, n, t, 2, 4, dk, dv, dtype=jnp.bfloat16)
    slots, lens = jnp.arange(2, 2 + n), jnp.array(lens_l)
    use = jnp.array([i % 2 == 0 for i in range(n)])
    o, new = _prefill_fn(config)(q, k, v, a, b, A_log, dt_bias, pool, slots, lens, use)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, a, b)]
    o_ref, new_ref = gdn_reference.gdn_prefill(*f32, A_log, dt_bias, pool, slots, lens, use, method="scan")
    real = (np.arange(t)[None] < np.asarray(lens)[:, None])[..., None, None]
    live = slots[np.asarray(lens) > 0]
    return (rel(np.where(real, np.asarray(o, np.float32), 0), np.where(real, o_ref, 0)),
            rel(new[live], new_ref[live]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lens", default="2048,0", help="sequence lengths, comma-separated")
    ap.add_argument("--configs", nargs="+", default=["", "mgpu=false"])
    args = ap.parse_args()
    lens = [int(x) for x in args.lens.split(",")]
    print(f"| overrides | o rel-L2 | state rel-L2 |  (lengths {lens})\n|---|---|---|")
    for spec in args.configs:
        config = dataclasses.replace(gdn.DEFAULT_PREFILL, **overrides(spec))
        err_o, err_s = errors(config, lens)
        print(f"| {spec or '(default)'} | {err_o:.2e} | {err_s:.2e} |", flush=True)


if __name__ == "__main__":
    main()

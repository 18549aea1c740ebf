"""The MoE expert kernels on the GPU against their reference, at a model's shapes: per-copy (`routed_experts`) and
sorted (`sorted_experts`) at several decode batches, against `routed_experts_reference` (ragged_dot) on the same
random inputs, bf16. The tests run the kernels in interpret mode only; this is their check compiled for the GPU.

    python bench/moe_check.py --config bench/configs/qwen3.5-35b-a3b.json --record
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import results  # noqa: E402
from pallas_kernels import expert_gemm  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="bench/configs/qwen3.5-35b-a3b.json")
    ap.add_argument("--batches", default="1,16,32,64,128")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    raw = json.load(open(args.config))
    text = raw.get("text_config", raw)
    h, e, k = text["hidden_size"], text["num_experts"], text["num_experts_per_tok"]
    i, i_s = text["moe_intermediate_size"], text["shared_expert_intermediate_size"]
    bf, f32 = jnp.bfloat16, jnp.float32
    ks = jax.random.split(jax.random.key(0), 8)
    r = lambda key, *shape, s=0.02: (s * jax.random.normal(key, shape, f32)).astype(bf)
    wg, wd = r(ks[0], e, h, 2 * i), r(ks[1], e, i, h)
    shared = (r(ks[2], h, 2 * i_s), r(ks[3], i_s, h), r(ks[4], h, 1))
    interpret = jax.default_backend() != "gpu"
    rows = []
    for m in (int(b) for b in args.batches.split(",")):
        x = r(jax.random.fold_in(ks[5], m), m, h, s=1.0)
        logits = jax.random.normal(jax.random.fold_in(ks[6], m), (m, e), f32).astype(bf)
        weights, experts = expert_gemm.router_top_k_reference(logits, k, jnp.ones(m, bool))
        experts = experts.at[0, -1].set(-1)                          # a copy of another rank's expert
        want = np.asarray(jax.jit(expert_gemm.routed_experts_reference)(x, experts, weights, wg, wd, shared))
        for name, fn in (("per_copy", expert_gemm.routed_experts), ("sorted", expert_gemm.sorted_experts)):
            got = np.asarray(jax.jit(lambda *a, fn=fn: fn(*a, interpret=interpret))(x, experts, weights, wg, wd,
                                                                                   shared))
            err = float(np.abs(got - want).max() / np.abs(want).max())
            row = {"batch": m, "kernels": name, "max abs diff / max abs ref": f"{err:.2e}",
                   "finite": bool(np.isfinite(got).all()), "pass": bool(err <= 1e-2 and np.isfinite(got).all())}
            rows.append(row)
            print(json.dumps(row), flush=True)
    body = (f"`{args.config}` shapes (H {h}, E {e}, k {k}, I {i}, shared {i_s}), random bf16 weights, the router's "
            "choice of random logits (one copy of another rank's expert), each kernel path against "
            "routed_experts_reference (ragged_dot); pass: max abs diff <= 1e-2 of max abs ref.\n\n"
            + results.table(rows, list(rows[0])))
    print(body)
    if args.record:
        results.record("MoE expert kernels against their reference (bench/moe_check.py)", body)
    if not all(r["pass"] for r in rows):
        sys.exit("MoE kernel check failed")


if __name__ == "__main__":
    main()

"""The fused MoE decode kernel (pallas_kernels.expert_gemm.moe_decode) against the two-kernel path it replaces
(the router's GEMM, router_top_k, routed_experts and the sum) at Qwen3.5-35B-A3B shapes, one layer, random bf16
weights: its output against moe_decode_reference on many calls (the kernel's programs wait on each other's
counts: a race would show as a call that differs), and each path's device time per call from a profiler trace.

  python bench/moe_decode.py [--batches 2,16] [--calls 50] [--record]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.timing import traced_us  # noqa: E402
from pallas_kernels import expert_gemm as ex  # noqa: E402

ints = lambda text: [int(x) for x in text.split(",") if x]


def two_kernels(x, live, offset, w_router, w_gate_up, w_down, shared, *, k, interpret):
    """The path before moe_decode: XLA's router GEMM, router_top_k, routed_experts, the sum."""
    logits = jnp.dot(x, w_router, preferred_element_type=x.dtype)
    top, idx = ex.router_top_k(logits, k, live, num_warps=ex.DEFAULT.router_num_warps, interpret=interpret)
    loc = idx - offset
    loc = jnp.where((loc >= 0) & (loc < w_gate_up.shape[0]), loc, -1)
    return ex.routed_experts(x, loc, top, w_gate_up, w_down, shared, interpret=interpret)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="2,16", help="tokens per call (the first one live only in the smallest)")
    ap.add_argument("--calls", type=int, default=50, help="calls checked against the reference per batch")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    interpret = jax.default_backend() != "gpu"
    h, e, k, i = args.hidden, args.experts, args.top_k, args.intermediate
    bf = jnp.bfloat16
    ks = jax.random.split(jax.random.key(0), 8)
    r = lambda key, *shape, s=0.02: (s * jax.random.normal(key, shape, jnp.float32)).astype(bf)
    w_router, w_gate_up, w_down = r(ks[0], h, e, s=0.05), r(ks[1], e, h, 2 * i), r(ks[2], e, i, h)
    shared = (r(ks[3], h, 2 * i), r(ks[4], i, h), r(ks[5], h, 1))
    fused = jax.jit(lambda *a: ex.moe_decode(*a, k=k, interpret=interpret))
    old = jax.jit(lambda *a: two_kernels(*a, k=k, interpret=interpret))
    ref = jax.jit(lambda *a: ex.moe_decode_reference(*a, k=k))
    rows = []
    for m in ints(args.batches):
        live = jnp.arange(m) < (1 if m == min(ints(args.batches)) else m)
        worst, differ = 0.0, 0
        first = None
        for c in range(args.calls if not interpret else 2):
            x = r(jax.random.fold_in(ks[6], c), m, h, s=1.0)
            a = (x, live, jnp.int32(0), w_router, w_gate_up, w_down, shared)
            got, want = np.asarray(fused(*a)), np.asarray(ref(*a))
            lv = np.asarray(live)
            scale = np.abs(want[lv]).max()
            worst = max(worst, float(np.abs(got[lv] - want[lv]).max() / scale))
            again = np.asarray(fused(*a))
            differ += int(not np.array_equal(got, again))
            assert not np.asarray(got[~lv]).any(), "padding rows must be zeros"
            first = a if first is None else first
        t_fused, kf = traced_us(fused, first)
        t_old, ko = traced_us(old, first)
        row = {"tokens": m, "live": int(np.asarray(live).sum()), "max_rel_err": worst, "calls_differing": differ,
               "fused_us": t_fused, "two_kernel_us": t_old}
        rows.append(row)
        top = lambda d: {n: round(v, 2) for n, v in sorted(d.items(), key=lambda kv: -kv[1])[:6]}
        print(row, "fused:", top(kf), "two-kernel:", top(ko), flush=True)
        if worst > 2e-2 or differ:
            raise SystemExit(f"moe_decode is wrong at {m} tokens: {row}")
    if args.record:
        from bench.results import record
        lines = ["| tokens | live | fused us | two-kernel us | max rel err | calls differing |",
                 "|---|---|---|---|---|---|"]
        lines += [f"| {w['tokens']} | {w['live']} | {w['fused_us']:.1f} | {w['two_kernel_us']:.1f} | "
                  f"{w['max_rel_err']:.2e} | {w['calls_differing']} |" for w in rows]
        record("Fused MoE decode kernel against the two-kernel path (bench/moe_decode.py)",
               f"One MoE layer at H={h}, E={e}, k={k}, I={i} (shared Is={i}), random bf16 weights; device time "
               "per call from a profiler trace; error against moe_decode_reference over the calls.\n\n"
               + "\n".join(lines), fields={"rows": rows})


if __name__ == "__main__":
    main()

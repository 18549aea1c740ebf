"""The MoE expert kernels on the GPU against their reference, at a model's shapes: per-copy (`routed_experts`) and
sorted (`sorted_experts`) at several token counts (decode batches, prefill chunks), against
`routed_experts_reference` (ragged_dot, which XLA runs as a dense dot over every expert: a 2048-token chunk of
35B-A3B takes a 17 GB temporary) on the same random inputs, bf16. The tests run the kernels in interpret mode only;
this is their check compiled for the GPU.
--sweep: then the device time of `sorted_experts` per tile configuration (SWEEP, fixed copies per block; "auto":
the defaults, whose blocks grow with the groups) at each --sweep-batches token count, its two kernels and the XLA
glue apart, beside ragged_dot's up to --reference-max tokens (profiler trace; one layer's 1.6 GB of experts, so no
call reads them from L2), to choose ExpertGemmConfig's sorted tiles.

    python bench/moe_check.py --config bench/configs/qwen3.5-35b-a3b.json --record
    python bench/moe_check.py --batches 64 --sweep --sweep-batches 64,256,2048,8192
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import results  # noqa: E402
from bench.timing import traced_us  # noqa: E402
from pallas_kernels import expert_gemm  # noqa: E402


# sorted_experts' tiles: (block_m, block_n, block_k, num_warps, num_stages), block_m fixed (block_m_max = block_m)
SWEEP = [(16, 64, 128, 4, 3), (16, 128, 128, 4, 3), (16, 64, 256, 4, 3), (16, 64, 64, 4, 3), (16, 64, 128, 4, 4),
         (16, 64, 128, 2, 3), (32, 64, 128, 4, 3), (32, 128, 128, 8, 3), (64, 64, 128, 4, 3), (64, 128, 64, 8, 3),
         (128, 64, 64, 8, 3)]


def sweep(batches, h, e, k, i, i_s, wg, wd, shared, record, interpret, reference_max):
    """Device time of sorted_experts per tile configuration at each batch: its kernels and the glue around them;
    ragged_dot's (the reference) up to reference_max tokens."""
    rows = []
    for m in batches:
        ks = jax.random.split(jax.random.key(m), 2)
        x = jax.random.normal(ks[0], (m, h), jnp.float32).astype(jnp.bfloat16)
        logits = jax.random.normal(ks[1], (m, e), jnp.float32).astype(jnp.bfloat16)
        weights, experts = expert_gemm.router_top_k_reference(logits, k, jnp.ones(m, bool))
        d = expert_gemm.DEFAULT
        fixed = lambda bm, bn, bk, nw, ns: dataclasses.replace(d, block_m=bm, block_m_max=bm, block_n=bn, block_k=bk,
                                                               num_warps=nw, num_stages=ns)
        forms = [("auto", d), *((f"{t[0]}", fixed(*t)) for t in SWEEP)]
        if m <= reference_max:
            forms.append(("ragged_dot", None))
        for name, cfg in forms:
            fn = (expert_gemm.routed_experts_reference if cfg is None else
                  lambda *a, cfg=cfg: expert_gemm.sorted_experts(*a, config=cfg, interpret=interpret))
            try:
                us, kernels = traced_us(fn, (x, experts, weights, wg, wd, shared), calls=10)
            except Exception as err:          # a tile Triton cannot take, or memory: recorded, not fatal
                print(json.dumps({"batch": m, "form": name, "error": str(err)[:200]}), flush=True)
                continue
            gate_up = sum(v for n, v in kernels.items() if "gate_up" in n)
            down = sum(v for n, v in kernels.items() if "down" in n)
            c = cfg or d
            bm = expert_gemm.block_m(c, m * (k + 1), e + 1)
            row = {"tokens": m, "form": name, "block_m": bm if cfg else "",
                   "block_n": c.block_n if cfg else "", "block_k": c.block_k if cfg else "",       # the kernels' warps:
                   "warps": c.num_warps * bm // c.block_m if cfg else "", "stages": c.num_stages if cfg else "",
                   "total us": f"{us:.1f}", "gate_up us": f"{gate_up:.1f}", "down us": f"{down:.1f}",
                   "glue us": f"{us - gate_up - down:.1f}"}
            rows.append(row)
            print(json.dumps(row), flush=True)
    body = (f"sorted_experts per tile configuration (auto: the defaults), H {h}, E {e}, k {k}, I {i}, shared {i_s}, "
            "random bf16 weights and router logits; device time per call from a profiler trace of 10 calls "
            "(gate_up / down: the two kernels; glue: the sort, block table and gather-sum); ragged_dot: the "
            "reference.\n\n" + results.table(rows, list(rows[0])))
    print(body)
    if record:
        results.record("Sorted MoE expert kernels by tile (bench/moe_check.py --sweep)", body)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="bench/configs/qwen3.5-35b-a3b.json")
    ap.add_argument("--batches", default="1,16,32,64,128,512,2048")
    ap.add_argument("--sweep", action="store_true", help="then time sorted_experts' tile configurations (SWEEP)")
    ap.add_argument("--sweep-batches", default="64,256,2048,8192")
    ap.add_argument("--reference-max", type=int, default=512, help="time ragged_dot up to this many tokens")
    ap.add_argument("--repeats", type=int, default=20,
                    help="calls of each kernel path per batch; every one must equal the first (a race would not)")
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
        operands = (x, experts, weights, wg, wd, shared)
        want = np.asarray(jax.jit(expert_gemm.routed_experts_reference)(*operands))
        for name, fn in (("per_copy", expert_gemm.routed_experts), ("sorted", expert_gemm.sorted_experts)):
            call = jax.jit(lambda *a, fn=fn: fn(*a, interpret=interpret))
            got = np.asarray(call(*operands))
            differ = sum(not np.array_equal(np.asarray(call(*operands)), got) for _ in range(args.repeats - 1))
            err = float(np.abs(got - want).max() / np.abs(want).max())
            row = {"batch": m, "kernels": name, "max abs diff / max abs ref": f"{err:.2e}",
                   "calls differing from the first": f"{differ} of {args.repeats - 1}",
                   "finite": bool(np.isfinite(got).all()),
                   "pass": bool(err <= 1e-2 and np.isfinite(got).all() and not differ)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    body = (f"`{args.config}` shapes (H {h}, E {e}, k {k}, I {i}, shared {i_s}), random bf16 weights, the router's "
            "choice of random logits (one copy of another rank's expert), each kernel path against "
            "routed_experts_reference (ragged_dot); pass: max abs diff <= 1e-2 of max abs ref, and every repeated call "
            "equal to the first.\n\n"
            + results.table(rows, list(rows[0])))
    print(body)
    if args.record:
        results.record("MoE expert kernels against their reference (bench/moe_check.py)", body)
    if not all(r["pass"] for r in rows):
        sys.exit("MoE kernel check failed")
    if args.sweep:
        sweep([int(b) for b in args.sweep_batches.split(",")], h, e, k, i, i_s, wg, wd, shared, args.record,
              interpret, args.reference_max)


if __name__ == "__main__":
    main()

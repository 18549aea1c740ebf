"""Where the precompile sweep's time goes: lowering (Python, under the GIL) and XLA compilation, per bucket.

Lowers and compiles a few of the engine's buckets one at a time (no persistent cache) and prints both times.
`--tiny-dims` keeps the config's layer structure with tiny widths (lowering cost follows the number of ops, not
their sizes), so the Python half can be measured on a CPU machine. The kernels as served (each under the
jax.jit that backends.make_kernels puts around it) are timed side by side with the bare kernels.

    python bench/compile_time.py --config bench/configs/qwen3.5-9b.json [--tiny-dims] [--kernel-backend pallas]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import results  # noqa: E402
from bench.common import add_kernel_args, kernel_config, random_engine  # noqa: E402
from qwen35_jax.model.backends import KernelConfig, make_kernels  # noqa: E402
from qwen35_jax.engine.engine import Engine, EngineArgs  # noqa: E402

TINY = dict(vocab_size=4096, hidden_size=64, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16,
            intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2,
            linear_num_value_heads=4)


def bare(kernels):
    """The kernels without the jit wrappers backends.make_kernels puts around them."""
    return dataclasses.replace(kernels, **{f.name: getattr(getattr(kernels, f.name), "__wrapped__",
                                                           getattr(kernels, f.name))
                                           for f in dataclasses.fields(kernels)})


def make_engine(raw: dict, config: KernelConfig, unjit: bool, weights=None) -> Engine:
    import qwen35_jax.engine.engine as engine_module
    jitted = engine_module.make_kernels
    if unjit:             # the engine makes its kernels through engine.make_kernels: hand it the bare ones
        engine_module.make_kernels = lambda c: bare(jitted(c))
    try:
        return random_engine(raw, EngineArgs(max_model_len=1536, max_num_seqs=64, max_num_batched_tokens=2048,
                                             max_prefill_rows=2, precompile=False, kernel_config=config),
                             weights=weights)
    finally:
        engine_module.make_kernels = jitted


def lower_decode_for_cuda(cfg, kernels, *, batch: int, slots: int, pages: int, pages_per_seq: int,
                          mode: str = "top") -> str:
    """One decode step (sampler mode `mode`: sampler.SAMPLER_MODES) lowered for CUDA (Pallas kernels through Triton)
    on any machine, from abstract inputs on an abstract H200 mesh: its StableHLO text. tests/test_kernels.py checks
    it for host round trips."""
    import functools
    from qwen35_jax.engine.executor import decode_step
    from qwen35_jax.engine.sampler import SAMPLER_MODES, SamplerState, SamplingBatch
    from qwen35_jax.model.sharding import DP, TP, Layout
    from qwen35_jax.model.state import abstract_state
    from qwen35_jax.model.weights import abstract_weights
    if mode not in SAMPLER_MODES:
        raise ValueError(f"sampler mode must be one of {SAMPLER_MODES}, got {mode!r}")
    layout = Layout.build(cfg, 1)
    S, i32, f32 = jax.ShapeDtypeStruct, jnp.int32, jnp.float32
    struct = lambda tree: jax.tree.map(lambda p: S(p.shape, p.dtype), tree, is_leaf=lambda x: hasattr(x, "axes"))
    weights = struct(abstract_weights(cfg, layout, jnp.bfloat16))
    state = struct(abstract_state(cfg, layout, slots, pages, 16, jnp.bfloat16))
    v, n = weights.embed.shape[0], slots + 1
    sstate = SamplerState(last_token=S((n,), i32), counts=S((n, v), i32), prompt_mask=S((n, v), jnp.bool_))
    sp = SamplingBatch(*(S((batch,), t) for t in (f32, i32, f32, f32, f32, f32, f32, jnp.uint32, i32, jnp.bool_)))
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    mesh = jax.sharding.AbstractMesh((1, 1), (DP, TP), abstract_device=dev)
    fn = jax.shard_map(functools.partial(decode_step, cfg, layout, kernels, 1, mode), mesh=mesh,
                       in_specs=jax.sharding.PartitionSpec(), out_specs=jax.sharding.PartitionSpec(), check_vma=False)
    with jax.sharding.use_abstract_mesh(mesh):
        bitmask = S((batch, -(-v // 32)), i32)       # the tokens each row may sample (structured outputs)
        return jax.jit(fn).trace(weights, state, sstate, bitmask, S((batch,), i32), S((batch,), i32),
                                 S((batch, pages_per_seq), i32), sp).lower(lowering_platforms=("cuda",)).as_text()


def cuda_decode_lowering_seconds(cfg, kernels) -> float:
    """Seconds to lower a 16-row decode step for CUDA (64 slots, 96 pages per row)."""
    t0 = time.perf_counter()
    lower_decode_for_cuda(cfg, kernels, batch=16, slots=64, pages=512, pages_per_seq=96)
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="bench/configs/qwen3.5-9b.json")
    ap.add_argument("--tiny-dims", action="store_true")
    add_kernel_args(ap)
    ap.add_argument("--no-compile", action="store_true", help="time lowering only")
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--cuda-lowering", action="store_true",
                    help="also lower a decode step for CUDA (Triton kernels) from this machine, both ways")
    args = ap.parse_args()

    raw = json.load(open(args.config))
    if args.tiny_dims:
        raw.update(TINY)
    cfg_kernels = kernel_config(args)
    first = make_engine(raw, cfg_kernels, False)
    engines = {"jit-wrapped": first, "bare": make_engine(raw, cfg_kernels, True, weights=first.weights)}
    cfg = first.cfg
    keys = engines["bare"].executor.keys()
    picked = [keys[0], next(k for k in keys if k[0] == "decode" and k[2]), next(k for k in keys if k[0] == "prefill"),
              keys[-1]]
    rows = []
    for i, key in enumerate(picked):
        row = {"bucket": str(key)}
        for name in (list(engines) if i % 2 == 0 else list(engines)[::-1]):     # alternate who goes first
            t0 = time.perf_counter()
            lowered = engines[name].executor._lower(key)
            t1 = time.perf_counter()
            if not args.no_compile:
                lowered.compile()
            row[f"{name} lower s"] = f"{t1 - t0:.2f}"
            if not args.no_compile:
                row[f"{name} compile s"] = f"{time.perf_counter() - t1:.2f}"
        rows.append(row)
        print(row, flush=True)
    if args.cuda_lowering:
        served = make_kernels(KernelConfig(backend="pallas", decode_split_k=4))     # lowered for CUDA from any host
        row = {"bucket": "decode 16 rows, lowered for CUDA (Triton)"}
        for name, kernels in (("bare", bare(served)), ("jit-wrapped", served), ("bare", bare(served))):
            row[f"{name} lower s"] = f"{cuda_decode_lowering_seconds(cfg, kernels):.2f}"     # bare twice: warm-up
        rows.append(row)
        print(row, flush=True)
    backend = engines["bare"].kernel_config.backend
    for e in engines.values():
        e.shutdown()
    cols = ["bucket"] + sorted((c for c in rows[0] if c != "bucket"), key=lambda c: ("compile" in c, c))
    body = (f"Config `{args.config}`{' with tiny widths (same layers)' if args.tiny_dims else ''}, kernel_backend="
            f"`{backend}`, {jax.devices()[0].platform}, no persistent cache; each bucket lowered (and compiled) for "
            f"the kernels as served (each under jax.jit) and bare, side by side.\n\n" + results.table(rows, cols))
    print(body)
    if args.record:
        results.record("Compile time per bucket (bench/compile_time.py)", body)


if __name__ == "__main__":
    main()

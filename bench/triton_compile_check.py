"""Compile the Pallas-Triton kernels for sm_90 on a machine without a GPU: shared memory, registers, spills.

CUDA cross-lowering (tests/test_kernels.py) only checks the Pallas -> Triton IR step. This tool goes one step
further: it dumps the Triton IR of every kernel in bench/kernel_sweeps.py's lists and decode_prologue at the 9B
shapes (with the project's Python), then compiles each one for sm_90 (H100/H200) with the PyPI `triton` package (any
machine, no driver needed: TTIR -> TTGIR -> PTX -> cubin with the ptxas it ships) and reports the dynamic shared
memory, registers, local-memory spills, programs per SM, the tensor-core path of the dots, how many loads
became asynchronous copies (the software pipeliner's work) and how many layout conversions the TTGIR holds (a static
count: a loop body counts once); the TTGIR is saved beside each .ttir. jaxlib bundles its
own Triton, so PyPI Triton's passes are a close proxy, not the exact compiler the GPU run uses.

  python bench/triton_compile_check.py dump /tmp/ttir              # the project's venv (jax)
  python3 -m venv /tmp/tritonenv && /tmp/tritonenv/bin/pip install triton
  /tmp/tritonenv/bin/python bench/triton_compile_check.py compile /tmp/ttir/*.ttir
"""
from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import tempfile


def dump(out_dir, only=()):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import jax
    import jax.numpy as jnp
    from jax._src.pallas.triton import pallas_call_registration as reg
    from bench import kernel_sweeps as ks
    from pallas_kernels import conv1d, gdn, paged_attention as pa, prefill_attention as pfa
    from pallas_kernels import expert_gemm as ex, gemv as gv

    os.makedirs(out_dir, exist_ok=True)
    captured, meta = [], []
    lower_module = reg.lowering.lower_jaxpr_to_triton_module
    custom_call = reg.mlir.custom_call

    def capture_module(*a, **k):
        r = lower_module(*a, **k)
        captured.append(r.module.operation.get_asm(enable_debug_info=False))
        return r

    def capture_call(*a, backend_config=None, **k):
        meta.append({kk: str(vv) for kk, vv in backend_config.items() if kk in ("num_warps", "num_stages", "name")})
        return custom_call(*a, backend_config=backend_config, **k)

    reg.lowering.lower_jaxpr_to_triton_module = capture_module
    reg.mlir.custom_call = capture_call
    S, bf, f32, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32, jnp.int32
    hk, hv, dk, dv, t, slots = 16, 32, 128, 128, 8192, 9
    prefill = (S((1, t, hk, dk), bf), S((1, t, hk, dk), bf), S((1, t, hv, dv), bf), S((1, t, hv), bf),
               S((1, t, hv), bf), S((hv,), f32), S((hv,), f32), S((slots, hv, dv, dk), f32), S((1,), i32),
               S((1,), i32), S((1,), jnp.bool_))
    decode = (S((64, hk, dk), bf), S((64, hk, dk), bf), S((64, hv, dv), bf), S((64, hv), bf), S((64, hv), bf),
              S((hv,), f32), S((hv,), f32), S((slots, hv, dv, dk), f32), S((64,), i32))
    # the Mosaic GPU scan is not a Triton kernel: these dump its prep kernels (and the Triton scan where mgpu=False)
    jobs = [(c.name, functools.partial(gdn.gdn_prefill, config=c), prefill) for c in ks.prefill_sweep()]
    jobs += [("dec_" + c.name, functools.partial(gdn.gdn_decode, config=c), decode) for c in ks.decode_sweep()]
    prologue = (S((64, 16 * 512 + 2048), bf), S((256,), bf), S((256,), bf), S((4, 8193, 16, 256), bf),
                S((4, 8193, 16, 256), bf), S((64, 512), i32), S((64,), i32), S((64,), i32))
    jobs.append(("attn_prologue_b64", functools.partial(pa.decode_prologue, q_heads=16, rotary_dim=64, theta=1e7,
                                                        eps=1e-6), prologue))
    for b in (1, 64):               # paged decode attention at 9B shapes (Hq 16, Hkv 4, D 256, page 16, 8k context)
        attn = (S((b, 16, 256), bf), S((4, 8193, 16, 256), bf), S((4, 8193, 16, 256), bf), S((b, 512), i32),
                S((b,), i32))
        jobs += [(f"attn_b{b}_{c.name}", functools.partial(pa.paged_decode_attention, config=c), attn)
                 for c in ks.attention_sweep()]
    # paged prefill attention: a 2048-token chunk at 9B (Hq 16) and 27B (Hq 24) shapes over 8k of context
    for hq in (16, 24):
        pre = (S((1, 2048, hq, 256), bf), S((4, 8193, 16, 256), bf), S((4, 8193, 16, 256), bf), S((1, 512), i32),
               S((1, 2048), i32), S((1,), i32))
        jobs += [(f"prefill_attn_hq{hq}_{c.name}", functools.partial(pfa.paged_prefill_attention, config=c), pre)
                 for c in ks.prefill_attention_sweep()]
    # conv1d prefill (8k tokens, one sequence) and decode (batch 256) at 9B shapes (8192 channels)
    conv_pre = (S((t, 8192), bf), S((4, 8192), bf), S((slots, 3, 8192), bf), S((1,), i32), S((1,), i32),
                S((1,), i32), S((1,), jnp.bool_))
    jobs += [(f"conv_prefill_{c.prefill_name}", functools.partial(conv1d.conv_prefill_packed, config=c), conv_pre)
             for c in ks.conv_prefill_sweep()]
    # as the model calls it: the whole input projection read in place, q, k and v written as arrays of their own
    jobs += [(f"conv_prefill_{'split_' if cuts else 'wide_'}{c.prefill_name}",
              functools.partial(conv1d.conv_prefill_packed, split=cuts, config=c), (S((t, 12352), bf), *conv_pre[1:]))
             for c in ks.conv_prefill_sweep() for cuts in ((2048, 4096), None)]
    conv_dec = (S((256, 12352), bf), S((4, 8192), bf), S((257, 3, 8192), bf), S((256,), i32))
    jobs += [(f"conv_decode_{c.decode_name}", functools.partial(conv1d.conv_decode, config=c), conv_dec)
             for c in ks.conv_decode_sweep()]
    # MoE at 35B-A3B shapes (H 2048, I 512, E 256, k 8): the router, the per-copy experts at batch 1 and 16, the
    # sorted experts at batch 64
    jobs += [(f"router_top_k_b{b}_w{w}", functools.partial(lambda x, live, w: ex.router_top_k(x, 8, live, num_warps=w),
                                                          w=w), (S((b, 256), bf), S((b,), jnp.bool_)))
             for b in (1, 64) for w in (1, 4)]
    shared = (S((2048, 1024), bf), S((512, 2048), bf), S((2048, 1), bf))
    jobs += [(f"routed_experts_b{b}", ex.routed_experts, (S((b, 2048), bf), S((b, 8), i32), S((b, 8), bf),
                                                          S((256, 2048, 1024), bf), S((256, 512, 2048), bf), shared))
             for b in (1, 16)]
    jobs.append(("sorted_experts_b64", ex.sorted_experts, (S((64, 2048), bf), S((64, 8), i32), S((64, 8), bf),
                                                           S((256, 2048, 1024), bf), S((256, 512, 2048), bf), shared)))
    # the decode GEMV at batch 1: the 9B in_proj, the 35B-A3B in_proj, the 9B out_proj (fp32 out, K split)
    jobs += [(f"gemv_{k}x{n}", functools.partial(gv.gemv, out_dtype=out), (S((1, k), bf), S((k, n), bf)))
             for k, n, out in ((4096, 12352, bf), (2048, 12352, bf), (4096, 4096, f32))]
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    for name, fn, shapes in jobs:
        if only and name not in only:
            continue
        captured.clear()
        meta.clear()
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=dev)):
            jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",))
        for i, (txt, m) in enumerate(zip(captured, meta)):
            base = os.path.join(out_dir, f"{name}__{i}_{m['name'].strip(chr(34))}")
            open(base + ".ttir", "w").write(txt)
            json.dump(m, open(base + ".json", "w"))
            print(base, m, flush=True)


def compile_all(paths):
    import warnings
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import triton
    from triton.backends.compiler import GPUTarget
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    target = GPUTarget("cuda", 90, 32)
    failed = 0
    for path in paths:
        m = json.load(open(path[:-5] + ".json"))
        nw, ns = int(m["num_warps"].split()[0]), int(m["num_stages"].split()[0])
        # jaxlib writes a load's eviction hint (`evictionPolicy = evict_first`: the GEMV's weight loads) in a form
        # PyPI Triton 3.9 does not parse; the hint changes no resource figure, so it is dropped for the compile
        text = open(path).read()
        hintless = re.sub(r" evictionPolicy = \w+", "", text)
        src = path
        if hintless != text:       # beside the dump, not in it (a glob of *.ttir would pick it up)
            src = os.path.join(tempfile.mkdtemp(), os.path.basename(path))
            open(src, "w").write(hintless)
        try:
            k = triton.compile(src, target=target, options={"num_warps": nw, "num_stages": ns})
            cubin = path[:-5] + ".cubin"
            open(cubin, "wb").write(k.asm["cubin"])
            res = subprocess.run([cuobjdump, "-res-usage", cubin], capture_output=True, text=True).stdout
            reg = int(re.search(r"REG:(\d+)", res).group(1))
            # ptxas puts register spills in the stack frame (STACK), not LOCAL; a frame means spills here
            local = int(re.search(r"STACK:(\d+)", res).group(1)) + int(re.search(r"LOCAL:(\d+)", res).group(1))
            smem = k.metadata.shared
            per_sm = min(227 * 1024 // max(smem, 1), 65536 // max(reg * 32 * nw, 1), 32)
            ttgir = k.asm["ttgir"]
            open(path[:-5] + ".ttgir", "w").write(ttgir)
            converts = len(re.findall(r"ttg\.convert_layout ", ttgir))      # layout changes (most via shared memory)
            wgmma = len(re.findall(r"ttng\.warp_group_dot ", ttgir))
            other = len(re.findall(r"= tt\.dot ", ttgir))
            # loads the software pipeliner turned into asynchronous global -> shared copies (cp.async / TMA)
            async_copies = len(re.findall(r"async_copy_global_to_local|async_tma_copy_global_to_local", ttgir))
            print(f"{os.path.basename(path)[:-5]:60s} warps={nw} stages={ns} smem={smem:6d} regs={reg:3d} "
                  f"spill={local} programs/SM={per_sm} wgmma={wgmma} other_dots={other} async_copies={async_copies} "
                  f"converts={converts}" + (" (eviction hints dropped)" if src != path else ""),
                  flush=True)
        except Exception as e:  # noqa: BLE001
            failed += 1
            print(os.path.basename(path), "FAILED", repr(e)[:3000], flush=True)
    return failed


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("dump", "compile"):
        sys.exit(__doc__)
    if sys.argv[1] == "dump":
        dump(sys.argv[2], set(sys.argv[3:]))
    else:
        sys.exit(1 if compile_all(sys.argv[2:]) else 0)

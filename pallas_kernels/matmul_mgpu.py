"""Decode-shaped matmul (few rows, large weight) as a Pallas Mosaic GPU kernel: TMA loads and wgmma (Hopper).

Why a second decode matmul: in the 9B decode step the Triton one (pallas_kernels/matmul.py) and XLA's GEMMs read
the weights at 70-85% of the copy bandwidth, and no tile, K split or pipeline depth of the Triton kernel moved
the step (bench/RESULTS.md, 2026-12-02). Triton waits for each tensor-core product before the next and stages
x's tiles like the weight's. Here the loads are TMA copies into a ring of max_concurrent_steps shared-memory
buffers (plgpu.emit_pipeline) and the products are asynchronous wgmma with one left in flight (wgmma_wait(1)):
a different machine for the same job, to find out on the H200 whether it reads the weights faster.

One program per (column block of bn, K range): rows padded to 64 (one wgmma M tile), K walked in steps of bk
= 64 (128-byte swizzled bf16 tiles), the fp32 accumulator in registers, the partial sums [split_k, 64, N] fp32
written through shared memory and added outside (as matmul.py's split K). The reference is matmul.reference
(XLA's dot). Runs on the CPU in Mosaic GPU's interpreter (interpret=True) and cross-lowers for CUDA there.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.matmul import fewest_splits

ROWS = 64                   # one wgmma M tile
BK = 64                     # bf16 elements in a 128-byte swizzle row
SMEM_BYTES = 220 * 1024


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    bn: int = 128             # output columns per program
    split_k: int = 1
    stages: int = 4           # TMA loads in flight (pipeline buffers)

    @property
    def name(self):
        return f"mg_n{self.bn}_s{self.split_k}_st{self.stages}"


def fits(m: int, k: int, n: int, config: MgpuConfig) -> bool:
    """Rows up to one M tile, N a multiple of bn, K of split_k * 64, and the pipeline's x and w tiles plus the
    output tile within shared memory."""
    smem = config.stages * (ROWS * BK + BK * config.bn) * 2 + ROWS * config.bn * 4
    return (m <= ROWS and config.stages >= 2 and config.bn % 64 == 0 and n % config.bn == 0
            and k % (config.split_k * BK) == 0
            and smem <= SMEM_BYTES)


def choose(m: int, k: int, n: int, programs: int = 264, bn: int = 128, stages: int = 4) -> MgpuConfig | None:
    """Column blocks of bn (64 where bn does not divide N) and the fewest K splits (up to 8, keeping >= 8 steps)
    that make >= programs programs; None where none fits (XLA's dot then)."""
    bn = bn if n % bn == 0 else 64
    return fewest_splits(lambda s: MgpuConfig(bn=bn, split_k=s, stages=stages),
                         lambda c: fits(m, k, n, c) and k // (c.split_k * BK) >= 8,
                         lambda c: n // bn * c.split_k >= programs, 8)


RULES = {"mgpu": {}, "mgpu_bn64": dict(bn=64), "mgpu_p528": dict(programs=528), "mgpu_st6": dict(stages=6),
         "mgpu_bn256_st3": dict(bn=256, stages=3)}      # QWEN35_DECODE_MATMUL names: keyword arguments of `choose`


def partial_sums(x, w, *, config: MgpuConfig, interpret: bool = False):
    """x [M <= 64, K] @ w [K, N] -> fp32 partial sums [split_k, 64, N] (rows past M are zeros)."""
    m, k = x.shape
    n = w.shape[1]
    if not fits(m, k, n, config):
        raise ValueError(f"mgpu matmul [{m}, {k}] @ [{k}, {n}] does not fit {config.name}: at most {ROWS} rows, "
                         f"N a multiple of {config.bn}, K of {config.split_k * BK}, and its tiles in "
                         f"{SMEM_BYTES} bytes of shared memory")
    xp = jnp.pad(x, ((0, ROWS - m), (0, 0)))
    bn, split = config.bn, config.split_k
    steps = k // (split * BK)
    tiles = (plgpu.TilingTransform((8, BK)), plgpu.SwizzleTransform(128))
    out_tiles = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))      # fp32: 32 per 128 bytes

    def body(x_gmem, w_gmem, o_gmem):
        j, s = lax.axis_index("n"), lax.axis_index("s")

        def products(acc_ref):
            def step(_, x_smem, w_smem):
                plgpu.wgmma(acc_ref, x_smem, w_smem)
                plgpu.wgmma_wait(1)              # the previous step's product is done: its buffers can refill
                                                 # (delay_release=1: the pipeline refills a slot one step late)
            plgpu.emit_pipeline(
                step, grid=(steps,),
                in_specs=[plgpu.BlockSpec((ROWS, BK), lambda i: (0, s * steps + i), transforms=tiles,
                                          delay_release=1),          # step i's buffers are still read by its
                          plgpu.BlockSpec((BK, bn), lambda i: (s * steps + i, j), transforms=tiles,  # product
                                          delay_release=1)],
                max_concurrent_steps=config.stages)(x_gmem, w_gmem)
            return acc_ref[...]

        acc = pl.run_scoped(products, plgpu.ACC((ROWS, bn), jnp.float32))

        def store(o_smem):
            o_smem[...] = acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[s, :, pl.ds(j * bn, bn)])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(store, plgpu.SMEM((ROWS, bn), jnp.float32, transforms=out_tiles))

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((split, ROWS, n), jnp.float32),
                        grid=(n // bn, split), grid_names=("n", "s"),
                        interpret=plgpu.InterpretGPUParams() if interpret else None)(xp, w)


def matmul(x, w, *, out_dtype=None, config: MgpuConfig, interpret: bool = False):
    """x [M, K] @ w [K, N] -> [M, N] in out_dtype (default x.dtype): the partial sums added in fp32, rounded once."""
    out = partial_sums(x, w, config=config, interpret=interpret)
    out = out[0] if config.split_k == 1 else jnp.sum(out, axis=0)
    return out[:x.shape[0]].astype(x.dtype if out_dtype is None else out_dtype)

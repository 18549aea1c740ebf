"""Grouped GEMM of token copies sorted by expert, reading only the experts that have tokens (Pallas-Triton).

Why a kernel: `jax.lax.ragged_dot` (the reference, `expert_gemm_reference`) sweeps every expert's weights on the GPU
whatever the group sizes: a decode step of Qwen3.5-35B-A3B routes a token to 8 of 256 experts per layer and read all
256 (bench/RESULTS.md, the 35B-A3B section). Here the copies are cut into blocks of `block_m` rows that each belong to
one expert (a group's last block is partly empty, never padded into the next group); a program multiplies one block by
one `block_n`-column tile of its expert's weights, indexed by the expert id it reads from the block table. Blocks past
the last group read nothing. Prefill steps, whose copies touch every expert many times over, keep ragged_dot: from
`max_rows` copies the backend calls it.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


@dataclasses.dataclass(frozen=True)
class ExpertGemmConfig:
    """Tiles: copies per block (Triton's smallest dot), weight columns per program, K per loop step; Triton's warps
    and pipeline depth. max_rows: from this many copies (M) the backend runs the reference (ragged_dot) instead."""
    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    max_rows: int = 4096


DEFAULT = ExpertGemmConfig()


def expert_gemm_reference(x, w, sizes, out_dtype=None):
    """The contract: x [M, K] token copies sorted by expert, group g holding the next sizes[g] rows; w [E, K, N];
    -> [M, N] with row m = x[m] @ w[its group], fp32 accumulation rounded once to out_dtype (default x.dtype);
    rows past sum(sizes) are zeros."""
    out = jax.lax.ragged_dot(x, w, sizes.astype(jnp.int32), preferred_element_type=jnp.float32)
    return out.astype(x.dtype if out_dtype is None else out_dtype)


def _kernel(expert_ref, x_ref, w_ref, o_ref, *, block_k):
    """Refs: expert [NB] (whole: each block's expert, -1 past the last group), x [BM, K] (this block's copies),
    w [E, K, N] (whole), o [BM, BN] (this block and column tile)."""
    b, j = pl.program_id(0), pl.program_id(1)
    e = expert_ref[b]
    bm, k = x_ref.shape
    bn = o_ref.shape[1]

    @pl.when(e >= 0)
    def _():
        def body(i, acc):
            xk = x_ref[:, pl.ds(i * block_k, block_k)]
            wk = w_ref[e, pl.ds(i * block_k, block_k), pl.ds(j * bn, bn)]
            return acc + pltriton.dot(xk, wk)

        acc = jax.lax.fori_loop(0, k // block_k, body, jnp.zeros((bm, bn), jnp.float32))
        o_ref[...] = acc.astype(o_ref.dtype)

    @pl.when(e < 0)                                              # an empty block reads no weights
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def expert_gemm(x, w, sizes, out_dtype=None, *, config: ExpertGemmConfig | None = None, interpret: bool = False):
    """expert_gemm_reference's contract as the kernel: the copies are laid into blocks of block_m rows, one
    expert per block (gathered in XLA: a decode step's few rows), the kernel writes each block's [block_m, N], and
    each copy's row is gathered back."""
    config = DEFAULT if config is None else config
    m, kdim = x.shape
    e, _, n = w.shape
    bm, bn, bk = config.block_m, min(config.block_n, n), min(config.block_k, kdim)
    for name, v in (("block_m", bm), ("block_n", bn), ("block_k", bk)):
        if v & (v - 1) or v < 16:
            raise ValueError(f"{name} ({v}) must be a power of two >= 16 (Triton block shapes)")
    if w.size >= 2 ** 31:       # the kernel's element offsets are int32
        raise ValueError(f"expert weights [{e}, {kdim}, {n}] have 2^31 elements or more: split the experts over "
                         "more devices (tp), or run jax.lax.ragged_dot (KernelConfig(expert_gemm=None))")
    if n % bn or kdim % bk:
        raise ValueError(f"expert weights [{e}, {kdim}, {n}]: K and N must be multiples of the tiles ({bk}, {bn})")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    sizes = sizes.astype(jnp.int32)
    # The block table by comparisons: jnp.searchsorted's default scan is a while loop, which a decode step must not
    # have (on the GPU each iteration is launched from the host).
    nb = -(-m // bm) + min(e, m)                          # each group adds at most one partly empty block
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    nblocks = -(-sizes // bm)                             # blocks per group
    bend = jnp.cumsum(nblocks)
    bstart = bend - nblocks
    blocks = jnp.arange(nb, dtype=jnp.int32)
    group = jnp.searchsorted(bend, blocks, side="right", method="compare_all").astype(jnp.int32)
    valid = group < e
    g = jnp.minimum(group, e - 1)
    rows = (starts[g] + (blocks - bstart[g]) * bm)[:, None] + jnp.arange(bm, dtype=jnp.int32)   # [NB, BM]
    inside = valid[:, None] & (rows < ends[g][:, None])
    xb = jnp.where(inside[..., None], x[jnp.minimum(rows, m - 1)], 0).reshape(nb * bm, kdim)
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=bk),
        grid=(nb, n // bn),
        in_specs=[pl.BlockSpec((nb,), lambda b, j: (0,)), pl.BlockSpec((bm, kdim), lambda b, j: (b, 0)),
                  pl.BlockSpec((e, kdim, n), lambda b, j: (0, 0, 0))],
        out_specs=pl.BlockSpec((bm, bn), lambda b, j: (b, j)),
        out_shape=jax.ShapeDtypeStruct((nb * bm, n), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret, name="expert_gemm",
    )(jnp.where(valid, g, -1), xb, w)
    # copy m of group h sits at row bstart[h] * bm + (m - starts[h]) of the blocks
    r = jnp.arange(m, dtype=jnp.int32)
    h = jnp.minimum(jnp.searchsorted(ends, r, side="right", method="compare_all").astype(jnp.int32), e - 1)
    return jnp.where((r < ends[-1])[:, None], out[bstart[h] * bm + r - starts[h]], 0).astype(out_dtype)

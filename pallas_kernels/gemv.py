"""A projection of a few rows, x [M <= 16, K] @ w [K, N], streaming w once (Pallas-Triton): decode at small batch.

Why a kernel: XLA's autotuner runs the batch-1 GDN in_proj and attention qkv of the 9B on 8 x 16 output tiles with
2 warps, which read the weights at ~60-64% of the copy bandwidth where gate_up's tiles read at ~88% (the 9B batch-1
profile, bench/RESULTS.md). Here one program owns a block_n-column tile of w over a range of K (split so that there
are at least min_programs programs), loads block_k x block_n weight tiles through Triton's pipeline and multiplies
them by the rows, loaded as Triton's smallest dot (16 rows) takes them. Rows past M, and a tile or range past N or
K, are masked, so any shape runs with no pad or slice around the kernel. Split K ranges write fp32 partial sums
that XLA adds (and rounds) in the consumer's fusion.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

ROWS = 16        # Triton's smallest dot: the rows are padded to it


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """Tiles (weight columns per program, K per loop step), Triton's warps and pipeline depth, and the least number
    of programs (K is split until the column tiles times the splits reach it). max_rows: decode projections of up
    to this many rows (tokens) run the kernel, larger ones XLA's GEMM (faster from two rows: bench/RESULTS.md).
    prefill_head: a prefill step's lm_head (its rows' last tokens, an untied head) on the kernel, where XLA ran a
    cuBLAS gemv on an fp32 copy of the head (bench/lm_head.py)."""
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    min_programs: int = 264
    max_rows: int = 1
    prefill_head: bool = True


DEFAULT = GemvConfig()


def gemv_reference(x, w, out_dtype=None):
    """The contract: x [M, K] @ w [K, N] -> [M, N], fp32 accumulation rounded once to out_dtype (default x.dtype)."""
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype if out_dtype is None else out_dtype)


def splits(n: int, k: int, config: GemvConfig) -> int:
    """K ranges per column tile: the least power of two giving min_programs programs, at most one per K step."""
    tiles, steps = -(-n // config.block_n), -(-k // config.block_k)
    s = 1
    while tiles * s < config.min_programs and 2 * s <= steps:
        s *= 2
    return s


def _kernel(x_ref, w_ref, o_ref, *, block_n, block_k, steps):
    """Program (j, s): column tile j over the s-th range of `steps` K steps. Refs: x [M, K], w [K, N] (whole),
    o [S * M, N] (whole: split s writes rows s * M ..). The rows are loaded as Triton's 16-row dot takes them, the
    rows past M and columns past K as zeros, and only the M rows and N columns are stored: no pad or slice
    kernels around the call."""
    j, s = pl.program_id(0), pl.program_id(1)
    m, kdim = x_ref.shape
    n = w_ref.shape[1]
    bn = block_n
    rows = jnp.arange(ROWS, dtype=jnp.int32)
    cols = j * bn + jnp.arange(bn, dtype=jnp.int32)

    def body(i, acc):
        k0 = (s * steps + i) * block_k
        ks = k0 + jnp.arange(block_k, dtype=jnp.int32)
        wk = pltriton.load(w_ref.at[pl.ds(k0, block_k), pl.ds(j * bn, bn)],
                           mask=(ks < kdim)[:, None] & (cols < n)[None, :], other=0, eviction_policy="evict_first")
        xk = pltriton.load(x_ref.at[rows[:, None], ks[None, :]], mask=(rows < m)[:, None] & (ks < kdim)[None, :],
                           other=0)
        return acc + pltriton.dot(xk, wk, allow_tf32=xk.dtype != jnp.float32)     # fp32 models: IEEE products

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((ROWS, bn), jnp.float32))
    pltriton.store(o_ref.at[(s * m + rows)[:, None], cols[None, :]], acc.astype(o_ref.dtype),
                   mask=(rows < m)[:, None] & (cols < n)[None, :])


def gemv(x, w, out_dtype=None, *, partials: bool = False, config: GemvConfig | None = None,
         interpret: bool = False):
    """gemv_reference's contract for M <= 16 rows as the kernel. partials: the fp32 partial sums of the K ranges,
    [S, M, N], unadded (for a consumer kernel to add, as router_top_k does)."""
    config = DEFAULT if config is None else config
    m, kdim = x.shape
    n = w.shape[1]
    if m > ROWS:
        raise ValueError(f"gemv takes at most {ROWS} rows, got {m}")
    for name, v in (("block_n", config.block_n), ("block_k", config.block_k)):
        if v & (v - 1) or v < 16:
            raise ValueError(f"GemvConfig.{name} ({v}) must be a power of two >= 16 (Triton block shapes)")
    if w.size >= 2 ** 31:
        raise ValueError(f"gemv weights {list(w.shape)} have 2^31 elements or more (int32 offsets)")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    bk = config.block_k
    s = splits(n, kdim, config)
    steps = -(-kdim // (bk * s))                         # K steps per range; the last range may run past K
    part_dtype = out_dtype if s == 1 and not partials else jnp.float32
    whole = lambda shape: pl.BlockSpec(shape, lambda j, s: (0,) * len(shape))
    out = pl.pallas_call(
        functools.partial(_kernel, block_n=config.block_n, block_k=bk, steps=steps),
        grid=(-(-n // config.block_n), s),
        in_specs=[whole(x.shape), whole(w.shape)], out_specs=whole((s * m, n)),
        out_shape=jax.ShapeDtypeStruct((s * m, n), part_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret, name="gemv",
    )(x, w)
    if partials:
        return out.reshape(s, m, n)
    return out.reshape(s, m, n).sum(0).astype(out_dtype) if s > 1 else out

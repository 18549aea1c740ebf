"""A projection of a few rows, x [M <= 16, K] @ w [K, N], streaming w once (Pallas-Triton): a prefill's lm_head.

Why a kernel: inside the prefill executable XLA ran the last token's head (one row against the 2 GB 9B head) as a
cuBLAS gemv on an fp32 copy of the head, several times slower than reading it once (bench/RESULTS.md). One program
owns a block_n-column tile of w over a range of K (split so that there are at least min_programs programs), loads
block_k x block_n weight tiles through Triton's pipeline and multiplies them by the rows padded to Triton's
smallest dot (16). A tile or range past N or K is masked, so any shape runs. Split K ranges write fp32 partial sums
that XLA adds (and rounds) in the consumer's fusion. Decode steps do not use it: beside a padding row, a lone
request's projections run faster on XLA's two-row GEMMs.
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
    of programs (K is split until the column tiles times the splits reach it)."""
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    min_programs: int = 264


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


def _kernel(x_ref, w_ref, o_ref, *, block_k, steps):
    """Program (j, s): column tile j over the s-th range of `steps` K steps. Refs: x [16, Kp] (zero rows and
    columns past M and K), w [K, N] (whole), o [16, BN] (this split's tile)."""
    j, s = pl.program_id(0), pl.program_id(1)
    kdim, n = w_ref.shape
    bn = o_ref.shape[-1]
    cols = j * bn + jnp.arange(bn, dtype=jnp.int32)

    def body(i, acc):
        k0 = (s * steps + i) * block_k
        rows = k0 + jnp.arange(block_k, dtype=jnp.int32)
        wk = pltriton.load(w_ref.at[pl.ds(k0, block_k), pl.ds(j * bn, bn)],
                           mask=(rows < kdim)[:, None] & (cols < n)[None, :], other=0, eviction_policy="evict_first")
        xk = x_ref[:, pl.ds(k0, block_k)]
        return acc + pltriton.dot(xk, wk, allow_tf32=xk.dtype != jnp.float32)     # fp32 models: IEEE products

    o_ref[...] = jax.lax.fori_loop(0, steps, body, jnp.zeros(o_ref.shape, jnp.float32)).astype(o_ref.dtype)


def gemv(x, w, out_dtype=None, *, config: GemvConfig | None = None, interpret: bool = False):
    """gemv_reference's contract for M <= 16 rows as the kernel."""
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
    xp = jnp.zeros((ROWS, steps * s * bk), x.dtype).at[:m, :kdim].set(x)
    part_dtype = out_dtype if s == 1 else jnp.float32
    nt = -(-n // config.block_n)
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=bk, steps=steps),
        grid=(nt, s),
        in_specs=[pl.BlockSpec(xp.shape, lambda j, s: (0, 0)), pl.BlockSpec(w.shape, lambda j, s: (0, 0))],
        out_specs=pl.BlockSpec((None, ROWS, config.block_n), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((s, ROWS, nt * config.block_n), part_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret, name="gemv",
    )(xp, w)
    return out.sum(0)[:m, :n].astype(out_dtype) if s > 1 else out[0, :m, :n]

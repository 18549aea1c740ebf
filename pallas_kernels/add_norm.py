"""The decode step's residual add and the RMSNorm after it, as one Pallas-Triton kernel.

Why a kernel: after each row-parallel projection of a decode step XLA ran two small kernels, one that adds the
GEMM's split-K partial sums and the residual, and one for the next RMSNorm (XLA fuses no two reductions of
different shapes), ~3-7 us each at 9B shapes on the H200: 128 per step. Here the model asks for the split-K
partial sums itself (model.row_parallel: a batched dot, the form XLA's own split K takes) and one program per row
sums them, adds the residual and normalises, so one kernel does what two did.

Contract (`reference` below): partials [S, M, H] fp32, residual x [M, H], norm weight w [H] (zero-centred: the
scale is 1 + w). Returns (x + round(sum_s partials[s]), RMSNorm(that) (1 + w)), both in x.dtype: the sum rounded
to x.dtype once, then added, as model.row_parallel and the `x = x + h` after it do. H need not be a power of two.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

NUM_WARPS = 8


def reference(partials, x, w, eps):
    xf = (x.astype(jnp.float32) + partials.sum(0).astype(x.dtype).astype(jnp.float32)).astype(x.dtype)
    f = xf.astype(jnp.float32)
    y = f * jax.lax.rsqrt(jnp.mean(f * f, axis=-1, keepdims=True) + eps) * (1.0 + w.astype(jnp.float32))
    return xf, y.astype(x.dtype)


def _kernel(p_ref, x_ref, w_ref, x_out_ref, y_ref, *, splits, bh, eps):
    r = pl.program_id(0)
    h = x_ref.shape[-1]
    cols = pl.ds(0, bh)
    mask = jnp.arange(bh, dtype=jnp.int32) < h
    acc = pltriton.load(p_ref.at[jnp.int32(0), r, cols], mask=mask, other=0)
    for s in range(1, splits):
        acc = acc + pltriton.load(p_ref.at[jnp.int32(s), r, cols], mask=mask, other=0)
    x = pltriton.load(x_ref.at[r, cols], mask=mask, other=0)
    xn = (x.astype(jnp.float32) + acc.astype(x.dtype).astype(jnp.float32)).astype(x_out_ref.dtype)
    pltriton.store(x_out_ref.at[r, cols], xn, mask=mask)
    f = xn.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.sum(f * f) / h + eps)
    w = pltriton.load(w_ref.at[cols], mask=mask, other=0).astype(jnp.float32)
    pltriton.store(y_ref.at[r, cols], (f * inv * (1.0 + w)).astype(y_ref.dtype), mask=mask)


def add_rms_norm(partials, x, w, eps, *, interpret=False):
    """See the module docstring: one program per row, the whole row (H padded to a power of two) in registers."""
    s, m, h = partials.shape
    if x.shape != (m, h) or w.shape != (h,):
        raise ValueError(f"add_rms_norm: partials {partials.shape}, residual {x.shape} and weight {w.shape} disagree")
    out = jax.ShapeDtypeStruct((m, h), x.dtype)
    return pl.pallas_call(
        functools.partial(_kernel, splits=s, bh=pl.next_power_of_2(h), eps=float(eps)),
        out_shape=(out, out), grid=(m,),
        compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret, name="add_rms_norm",
    )(partials.astype(jnp.float32), x, w)

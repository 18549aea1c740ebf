"""Decode's residual add and the RMSNorm after it, with the K-split sum of the projection before them, as one
Pallas-Triton kernel.

Why a kernel: XLA splits the decode step's row-parallel GEMMs over K (out_proj, o_proj and down_proj of the 9B at 64
rows: 8 ranges, fp32 partials [8, M, N]) and adds the partials up in a fusion of its own, which also adds the
residual (4.2-4.5 us on the H200); the RMSNorm of the sum is one more kernel (2.1-2.3 us), and a step has 64 such
pairs (bench/RESULTS.md, the batch-64 profile at 17358e7). With this kernel the model splits those GEMMs over K
itself (a batched dot, model.row_parallel) and one program per row adds the partials in a fixed order, rounds the
projection to the model dtype, adds the residual and normalises the sum: one kernel where there were two.

Contract (`reference` below): parts [S, M, N] fp32, x [M, N], w [N] (zero-centred norm weight: scale 1 + w) ->
(x + round(sum_s parts), its RMSNorm), both in x.dtype; the norm in fp32 and rounded once, as model.rms_norm_1p.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def reference(parts, x, w, eps):
    """The unfused ops: the partial sums added and rounded, the residual add, the zero-centred RMSNorm."""
    x = x + jnp.sum(parts, axis=0).astype(x.dtype)
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return x, (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def _kernel(parts_ref, x_ref, w_ref, x_out_ref, y_ref, *, eps):
    m = pl.program_id(0)
    splits, _, n = parts_ref.shape
    bn = pl.next_power_of_2(n)
    cols = pl.ds(0, bn)
    mask = jnp.arange(bn, dtype=jnp.int32) < n                # masked lanes load 0 and add nothing to the sum
    part = lambda s: pltriton.load(parts_ref.at[jnp.int32(s), m, cols], mask=mask, other=0.0)   # (interpret mode's
    h = part(0)                                               # masked loads take no Python int index)
    for s in range(1, splits):                                # a fixed order: the same sum in every run
        h = h + part(s)
    x = pltriton.load(x_ref.at[m, cols], mask=mask, other=0)
    x = (x.astype(jnp.float32) + h.astype(x.dtype).astype(jnp.float32)).astype(x_out_ref.dtype)
    pltriton.store(x_out_ref.at[m, cols], x, mask=mask)
    xf = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.sum(xf * xf) / n + eps)
    w = pltriton.load(w_ref.at[cols], mask=mask, other=0).astype(jnp.float32)
    pltriton.store(y_ref.at[m, cols], (xf * inv * (1.0 + w)).astype(y_ref.dtype), mask=mask)


def residual_norm(parts, x, w, eps, *, interpret=False):
    """parts [S, M, N] fp32 (a projection's K-split partial sums), x [M, N] the residual stream, w [N] the next
    norm's weight -> (x + projection, its RMSNorm), both [M, N] in x.dtype. One program per row."""
    splits, m, n = parts.shape
    if parts.dtype != jnp.float32 or x.shape != (m, n) or w.shape != (n,):
        raise ValueError(f"residual_norm takes fp32 parts [S, M, N] with x [M, N] and w [N]; got parts "
                         f"{parts.shape} {parts.dtype}, x {x.shape}, w {w.shape}")
    out = jax.ShapeDtypeStruct((m, n), x.dtype)
    return pl.pallas_call(
        functools.partial(_kernel, eps=eps),
        out_shape=(out, out), grid=(m,),
        compiler_params=pltriton.CompilerParams(num_warps=8 if n >= 4096 else 4, num_stages=1),
        interpret=interpret, name="residual_norm",
    )(parts, x, w)

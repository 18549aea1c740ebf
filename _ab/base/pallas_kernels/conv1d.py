"""Pallas (Triton) kernels of the causal depthwise conv1d + SiLU of the Gated DeltaNet: prefill and decode.

Contract: pallas_kernels/conv1d_reference.py (beside this file). weight [K, C] (w[K-1] on the current token);
conv state pool [slots, K-1, C] in the model dtype holding each slot's last K-1 pre-conv inputs, oldest first;
fp32 accumulation in the reference's order, output in x.dtype. Channels need not be a power of two (masked).
Slot 0 is the null slot: padded decode rows use it.

Prefill: one program per (sequence, BT-token block, BC-channel block) reads the shifted inputs x[t - d] straight
from memory (L1/L2 serve the overlap), so nothing is copied or padded: a row gather clamped to the sequence's
first row, so no load starts before it. In a sequence's first block the rows before it take the slot's state,
and that block writes the final state (the last K-1 real inputs, part of the old state for sequences shorter
than K-1) back in place. One code path for every block (a branch that shifted the first block's tile cost every
program registers and occupancy). With `split` (the model's q | k | v as arrays of their own, so that no slice
copies them for the GDN kernels) each program stores its tile under a branch per part, into the part holding its
channel block. Decode: one program per (row, channel block), state in place. docs/kernels.md has the tiling.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")


@dataclasses.dataclass(frozen=True)
class ConvConfig:
    """Tiles of the conv kernels (the defaults: the fastest of the H200 sweeps, bench/kernel_sweeps.py)."""
    bt: int = 32            # prefill tokens per program
    bc: int = 128           # prefill channels per program
    num_warps: int = 4      # prefill warps
    decode_bc: int = 2048   # decode channels per program
    decode_warps: int = 8

    @property
    def prefill_name(self):
        return f"bt{self.bt}_bc{self.bc}_w{self.num_warps}"

    @property
    def decode_name(self):
        return f"bc{self.decode_bc}_w{self.decode_warps}"


def _i(i):
    """A static index as an int32 array (interpret mode's masked load/store rejects plain Python ints)."""
    return jnp.asarray(i, jnp.int32)


def _conv_sum(xs, ws):
    """sum_j xs[j] * ws[j] in the reference's order (xs[0] is the oldest input, ws[0] = w[0])."""
    acc = xs[0] * ws[0]
    for x, w in zip(xs[1:], ws[1:]):
        acc = acc + x * w
    return acc


def _prefill_kernel(start_ref, len_ref, span_ref, slot_ref, use_ref, x_ref, w_ref, pool_ref, *out_refs, bt, bc, taps,
                    split):
    *y_refs, pool_out_ref = out_refs
    n, tb, cb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, length, span, slot = start_ref[n], len_ref[n], span_ref[n], slot_ref[n]
    c_total = w_ref.shape[-1]                       # x may have more columns than the conv's channels
    km1 = taps - 1
    t0 = tb * bt
    cols = pl.ds(cb * bc, bc)
    col_idx = cb * bc + jnp.arange(bc, dtype=jnp.int32)
    cmask = col_idx < c_total
    rows = jnp.arange(bt, dtype=jnp.int32)
    tile_mask = (rows < span - t0)[:, None] & cmask[None, :]

    @pl.when(t0 < span)
    def _():
        ws = [pltriton.load(w_ref.at[_i(j), cols], mask=cmask, other=0).astype(jnp.float32) for j in range(taps)]
        # x[t - d] by a row gather clamped to the sequence's first row; rows before it (a sequence's first block
        # only) take the slot's state instead, whose rows only that block loads
        first = tb == 0
        use = use_ref[n] != 0
        st = [pltriton.load(pool_ref.at[slot, _i(m), cols], mask=cmask & first & use, other=0)
              .astype(x_ref.dtype).astype(jnp.float32) for m in range(km1)]
        xs = []
        for d in range(km1, -1, -1):
            src = t0 + rows - d
            xd = pltriton.load(x_ref.at[(start + jnp.maximum(src, 0))[:, None], col_idx[None, :]], mask=tile_mask,
                               other=0)
            xd = xd.astype(jnp.float32)
            for r in range(d):                   # src < 0 only for rows r < d of the first block
                xd = jnp.where(first & (rows == r)[:, None], st[km1 - d + r][None, :], xd)
            xs.append(xd)
        y = jax.nn.silu(_conv_sum(xs, ws)).astype(x_ref.dtype)
        out_rows = pl.ds(start + t0, bt)
        if not split:          # no branch around the one store (one cost 139 registers instead of 88 at 64 x 128)
            pltriton.store(y_refs[0].at[out_rows, cols], y, mask=tile_mask)
        else:                  # a store per part, under a branch: the part holding this channel block stores
            for y_ref, lo, hi in zip(y_refs, (0, *split), (*split, c_total)):
                @pl.when((cb * bc >= lo) & (cb * bc < hi))
                def _():
                    pltriton.store(y_ref.at[out_rows, pl.ds(cb * bc - lo, bc)], y, mask=tile_mask)

        @pl.when(first)
        def _():   # final state: inputs length-K+1 .. length-1 (older ones from the previous state)
            for i in range(km1):
                p = length - km1 + i
                from_x = pltriton.load(x_ref.at[start + jnp.maximum(p, 0), cols], mask=cmask, other=0)
                old = pltriton.load(pool_ref.at[slot, jnp.clip(p + km1, 0, km1 - 1), cols], mask=cmask, other=0)
                old = jnp.where(use, old.astype(x_ref.dtype).astype(pool_out_ref.dtype), 0)
                val = jnp.where(p >= 0, from_x.astype(pool_out_ref.dtype), old)
                pltriton.store(pool_out_ref.at[slot, _i(i), cols], val, mask=cmask)


def conv_prefill_packed(x, w, pool, starts, lens, slots, use_state, *, spans=None, max_span=None, split=None,
                        config: ConvConfig = ConvConfig(), interpret=False):
    """Packed conv prefill. The channels are x's first C = w.shape[1] columns (x [total, >= C]: the model passes
    the whole input projection, read in place); sequence n is rows [starts[n], starts[n] + lens[n]); outputs are
    written for rows [starts, starts + spans) (spans default to lens; the conv simply continues over padding);
    max_span: static bound on spans (default total). Returns (y [total, C] in x.dtype, pool); with split (channel
    offsets, as jnp.split takes them) y is the tuple of its parts, each written by the kernel as an array of its own."""
    (total, width), (taps, c) = x.shape, w.shape
    if width < c:
        raise ValueError(f"conv input has {width} columns, fewer than the weight's {c} channels")
    if taps < 2 or config.bt < taps - 1:
        raise ValueError(f"conv width {taps} needs 2 <= K <= bt + 1 (bt={config.bt})")
    cuts = tuple(split or ())
    if list(cuts) != sorted(set(cuts)) or any(not 0 < s < c for s in cuts):
        raise ValueError(f"conv split {cuts} must be increasing channel offsets inside (0, {c})")
    n = starts.shape[0]
    i32 = lambda v: jnp.asarray(v).astype(jnp.int32)
    starts, lens, slots, use_state = i32(starts), i32(lens), i32(slots), i32(use_state)
    spans = lens if spans is None else i32(spans)
    max_span = max_span or total
    bc = min(config.bc, pl.next_power_of_2(c))
    while any(s % bc for s in cuts):              # a channel block never straddles two parts
        bc //= 2
    widths = [hi - lo for lo, hi in zip((0, *cuts), (*cuts, c))]
    *ys, pool = pl.pallas_call(
        functools.partial(_prefill_kernel, bt=config.bt, bc=bc, taps=taps, split=cuts),
        out_shape=(*(jax.ShapeDtypeStruct((total, wd), x.dtype) for wd in widths),
                   jax.ShapeDtypeStruct(pool.shape, pool.dtype)),
        grid=(n, pl.cdiv(max_span, config.bt), pl.cdiv(c, bc)),
        input_output_aliases={7: len(widths)},
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=1),
        interpret=interpret, name="conv_prefill",
    )(starts, lens, spans, slots, use_state, x, w, pool)
    return (ys[0] if split is None else tuple(ys)), pool


def conv_prefill(x, w, pool, slots, lens, use_state, *, split=None, config: ConvConfig = ConvConfig(),
                 interpret=False):
    """The model's padded-batch contract (conv1d_reference.conv_prefill); x [N, T, >= C]."""
    n, t, width = x.shape
    y, pool = conv_prefill_packed(x.reshape(n * t, width), w, pool, jnp.arange(n, dtype=jnp.int32) * t, lens, slots,
                                  use_state, spans=jnp.full((n,), t, jnp.int32), max_span=t, split=split,
                                  config=config, interpret=interpret)
    shape = lambda part: part.reshape(n, t, part.shape[-1])
    return (shape(y) if split is None else tuple(map(shape, y))), pool


def _decode_kernel(slot_ref, x_ref, w_ref, pool_ref, y_ref, pool_out_ref, *, bc, taps):
    n, cb = pl.program_id(0), pl.program_id(1)
    slot = slot_ref[n]
    cols = pl.ds(cb * bc, bc)
    cmask = cb * bc + jnp.arange(bc, dtype=jnp.int32) < w_ref.shape[-1]          # x may have more columns
    st = [pltriton.load(pool_ref.at[slot, _i(m), cols], mask=cmask, other=0) for m in range(taps - 1)]
    x = pltriton.load(x_ref.at[n, cols], mask=cmask, other=0)
    ws = [pltriton.load(w_ref.at[_i(j), cols], mask=cmask, other=0).astype(jnp.float32) for j in range(taps)]
    xs = [s.astype(x.dtype).astype(jnp.float32) for s in st] + [x.astype(jnp.float32)]
    pltriton.store(y_ref.at[n, cols], jax.nn.silu(_conv_sum(xs, ws)).astype(y_ref.dtype), mask=cmask)
    new = st[1:] + [x.astype(pool_out_ref.dtype)]
    for m in range(taps - 1):
        pltriton.store(pool_out_ref.at[slot, _i(m), cols], new[m], mask=cmask)


def conv_decode(x, w, pool, slots, *, config: ConvConfig = ConvConfig(), interpret=False):
    """One token per row: the channels are x's first C = w.shape[1] columns (x [N, >= C]: the model passes the
    whole input projection, read in place); y [N, C]. The slot's state is shifted in place. Padded rows use the
    null slot 0."""
    (n, width), (taps, c) = x.shape, w.shape
    if width < c:
        raise ValueError(f"conv input has {width} columns, fewer than the weight's {c} channels")
    bc = min(config.decode_bc, pl.next_power_of_2(c))
    y, pool = pl.pallas_call(
        functools.partial(_decode_kernel, bc=bc, taps=taps),
        out_shape=(jax.ShapeDtypeStruct((n, c), x.dtype), jax.ShapeDtypeStruct(pool.shape, pool.dtype)),
        grid=(n, pl.cdiv(c, bc)),
        input_output_aliases={3: 1},
        compiler_params=pltriton.CompilerParams(num_warps=config.decode_warps, num_stages=1),
        interpret=interpret, name="conv_decode",
    )(jnp.asarray(slots).astype(jnp.int32), x, w, pool)
    return y, pool

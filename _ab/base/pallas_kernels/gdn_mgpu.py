"""The T-form GDN prefill scan as a Pallas Mosaic GPU kernel (Hopper: TMA loads, asynchronous wgmma).

The math of gdn's Triton T-form scan (`gdn._scan_kernel`), per 64-token chunk, with the state H [dk, BV] fp32 in
registers:

    Z = K H, Y = Q H                        bf16 products (H rounded to bf16)
    X = beta V - fw Z                       fp32, row factors from the prep (f rows 3, 4)
    Vnew = T X                              T and X rounded to bf16
    O = fq Y + P Vnew                       P and Vnew rounded to bf16
    H = e^gamma_C H + K^T (fk Vnew)         fk Vnew rounded to bf16

Why a second scan kernel: Triton waits for every tensor-core product right after issuing it, so each product of
the chunk loop costs its whole latency. Here the chunk's tiles arrive by TMA a chunk ahead (two buffers), the
products that do not depend on each other are issued together (K H with Q H; P Vnew with the state update), and T
and P arrive as bf16 tiles, ready tensor-core operands (docs/kernels.md).

Inputs: q, k [total, Hk, dk], v [total, Hv, dv] raw bf16; T and P [chunks, Hv, 64, 64] bf16 (gdn.wy_solve /
gdn.wy_prep with bf16 outputs); f [chunks, Hv, 5, 64] fp32 (gdn.wy_prep); sequence starts multiples of 8 (TMA copies
into swizzled tiles take whole 8-row tiles). The output goes by TMA straight into its rows; a tail chunk as
power-of-two row pieces (TMA cannot mask rows, and the rows after a tail belong to the next sequence). Each program
reads its initial state from its slot of the pool and writes the final state back in place (the pool is a mutable
ref: an aliased input / output), both in the pool's [dv, dk] orientation through the WGMMA_TRANSPOSED layout.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

CHUNK = 64          # = gdn.CHUNK (gdn imports this module)
BUFFERS = 2         # TMA buffers per tile: the next chunk's tiles load while a chunk computes
SHARED = ("q", "k", "t", "p", "f")   # the tiles with one TMA barrier each per buffer (v has its own)


def _swizzle(cols: int, dtype) -> tuple:
    """Tiling and swizzle transforms of a [rows, cols] shared-memory tile (the widest swizzle its rows allow)."""
    row_bytes = cols * jnp.dtype(dtype).itemsize
    swizzle = min(128, row_bytes)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def split_bf16(x):
    """fp32 -> (hi, lo) bf16 with hi + lo = x to ~2^-16 relative (gdn's "bf16x2" products)."""
    hi = x.astype(jnp.bfloat16)
    return hi, (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)


def _rows(vec, bv):
    """A [64] vector of per-row factors broadcast over a [64, bv] tile."""
    return lax.broadcast_in_dim(vec, (CHUNK, bv), [0])


def _b(ref):
    """A right operand [K, N] held K-major ([N, K] in shared memory: 128-byte rows for any N, where N-major tiles of
    N = 32 did not lower)."""
    return ref.transpose((1, 0))


def _store_kmajor(ref, x):
    """x [K, N] (registers) -> ref [N, K] bf16."""
    ref.transpose((1, 0))[...] = x.astype(ref.dtype)


def _scan_body(seq_ref, q_ref, k_ref, v_ref, t_ref, p_ref, f_ref, pool_ref, o_ref, *, ratio, bv):
    n, hv, vb = lax.axis_index("n"), lax.axis_index("h"), lax.axis_index("vb")
    kh = lax.div(hv, jnp.int32(ratio))
    dk = q_ref.shape[-1]
    start, length, coff, span, slot, use = (seq_ref[i, n] for i in range(6))
    nch = lax.div(length + CHUNK - 1, jnp.int32(CHUNK))
    vcols = pl.ds(pl.multiple_of(vb * bv, bv), bv)
    wgl, wgt = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA_TRANSPOSED
    row = wgl.reduce(1)
    tile_acc = plgpu.ACC((CHUNK, bv), jnp.float32)

    def kernel(q_s, k_s, t_s, p_s, f_s, v_s, h_s, x_s, vk_s, o_s, bars, vbars):
        def store_rows(row, nrows):
            """o_s rows [0, nrows) (nrows <= 64) -> o rows [row, row + nrows) of this program's columns, a partial
            tile as power-of-two pieces."""
            out = lambda r, m: o_ref.at[pl.ds(r, m), hv, vcols]
            pl.when(nrows == CHUNK)(lambda: plgpu.copy_smem_to_gmem(o_s, out(row, CHUNK)))

            @pl.when(nrows < CHUNK)
            def _():
                off = 0
                for m in (32, 16, 8, 4, 2, 1):
                    pl.when(lax.bitwise_and(nrows, m) != 0)(
                        lambda off=off, m=m: plgpu.copy_smem_to_gmem(o_s.at[pl.ds(off, m)], out(row + off, m)))
                    off = off + lax.bitwise_and(nrows, m)

        def fetch(c, slot):
            """Chunk c's tiles into buffer `slot`."""
            row0, cc = pl.multiple_of(start + c * CHUNK, 8), coff + c      # starts are multiples of 8: scan()
            srcs = dict(q=q_ref.at[pl.ds(row0, CHUNK), kh], k=k_ref.at[pl.ds(row0, CHUNK), kh], t=t_ref.at[cc, hv],
                        p=p_ref.at[cc, hv], f=f_ref.at[cc, hv])
            dsts = dict(q=q_s, k=k_s, t=t_s, p=p_s, f=f_s)
            plgpu.copy_gmem_to_smem(v_ref.at[pl.ds(row0, CHUNK), hv, vcols], v_s.at[slot], vbars.at[slot])
            for i, name in enumerate(SHARED):
                plgpu.copy_gmem_to_smem(srcs[name], dsts[name].at[slot], bars.at[slot * len(SHARED) + i])

        pl.when(nch > 0)(lambda: fetch(0, 0))

        # the initial state H [dk, BV] fp32, read from the pool's [dv, dk] rows of its slot (a column of H is a row
        # there: each warp's loads still fill whole 32-byte sectors); zeros where the sequence starts fresh
        h_pool = lambda ref: ref.at[slot, hv, vcols, :].transpose((1, 0))
        h = lax.cond(use != 0,
                     lambda: plgpu.layout_cast(plgpu.load(h_pool(pool_ref), layout=wgt, optimized=False), wgl),
                     lambda: plgpu.layout_cast(jnp.zeros((dk, bv), jnp.float32), wgl))

        fd_at = lambda c: f_ref[coff + jnp.clip(c, 0, jnp.maximum(nch - 1, 0)), hv, 2, 0]   # a chunk's decay (HBM)

        def put_o(c, o, tail):
            """Chunk c's output tile o -> o_s -> o's rows (a tail's valid ones)."""
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)     # the previous chunk's output has left o_s
            o_s[...] = o.astype(o_s.dtype)
            plgpu.commit_smem()
            if tail:                                            # the last, partial chunk: its valid rows only
                store_rows(start + c * CHUNK, length - c * CHUNK)
            else:
                plgpu.copy_smem_to_gmem(o_s, o_ref.at[pl.ds(start + c * CHUNK, CHUNK), hv, vcols])

        def chunk(c, carry, tail=False):
            h, fd = carry
            fd_next = fd_at(c + 1)                              # loaded a chunk ahead: off the critical path
            slot = lax.rem(c, jnp.int32(BUFFERS))
            pl.when(c + 1 < nch)(lambda: fetch(c + 1, lax.rem(c + 1, jnp.int32(BUFFERS))))   # the next chunk's

            for i in range(len(SHARED)):
                plgpu.barrier_wait(bars.at[slot * len(SHARED) + i])
            plgpu.barrier_wait(vbars.at[slot])
            qs, ks, ts, ps = q_s.at[slot], k_s.at[slot], t_s.at[slot], p_s.at[slot]
            _store_kmajor(h_s, h)
            plgpu.commit_smem()

            def zy(z_acc, y_acc):                               # Z = K H and Y = Q H, issued together
                plgpu.wgmma(z_acc, ks, _b(h_s))
                plgpu.wgmma(y_acc, qs, _b(h_s))
                return z_acc[...], y_acc[...]
            z, y = pl.run_scoped(zy, tile_acc, tile_acc)
            fq, fk, fw, beta = [plgpu.load(f_s.at[slot].at[i], layout=row) for i in (0, 1, 3, 4)]
            v = plgpu.load(v_s.at[slot], layout=wgl).astype(jnp.float32)
            _store_kmajor(x_s, _rows(beta, bv) * v - _rows(fw, bv) * z)
            plgpu.commit_smem()

            def tx(acc):                                        # Vnew = T X
                plgpu.wgmma(acc, ts, _b(x_s))
                return acc[...]
            vnew = pl.run_scoped(tx, tile_acc)
            _store_kmajor(x_s, vnew)                            # X is spent: its buffer takes Vnew
            _store_kmajor(vk_s, _rows(fk, bv) * vnew)
            plgpu.commit_smem()

            def pv_update(o_acc, h_acc):                        # the state update and P Vnew, issued together
                plgpu.wgmma(h_acc, ks.transpose((1, 0)), _b(vk_s))
                plgpu.wgmma(o_acc, ps, _b(x_s))
                return o_acc[...], h_acc[...]
            pv, upd = pl.run_scoped(pv_update, tile_acc, plgpu.ACC((dk, bv), jnp.float32))
            put_o(c, _rows(fq, bv) * y + pv, tail)
            return fd * h + upd, fd_next

        # the whole chunks in one loop (no conditional store in it), a partial last chunk in a loop of one
        full = lax.div(length, jnp.int32(CHUNK))
        carry = lax.fori_loop(0, full, chunk, (h, fd_at(0)))
        h, _ = lax.fori_loop(full, nch, functools.partial(chunk, tail=True), carry)
        h_pool(pool_ref)[...] = plgpu.layout_cast(h, wgt)        # the final state, in place in its slot

        @pl.when(span > length)
        def _():                                                # rows [len, span) (a padded batch's): zeros
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            o_s[...] = jnp.zeros((CHUNK, bv), o_s.dtype)
            plgpu.commit_smem()
            pad, row = span - length, start + length
            lax.fori_loop(0, lax.div(pad, jnp.int32(CHUNK)),
                          lambda i, _: store_rows(row + i * CHUNK, jnp.int32(CHUNK)), None)
            store_rows(row + pad - lax.rem(pad, jnp.int32(CHUNK)), lax.rem(pad, jnp.int32(CHUNK)))

        plgpu.wait_smem_to_gmem(0)

    bf, f32 = jnp.bfloat16, jnp.float32
    tile = lambda shape, dtype, swz=True: plgpu.SMEM(shape, dtype,
                                                     transforms=_swizzle(shape[-1], dtype) if swz else ())
    pl.run_scoped(
        kernel,
        tile((BUFFERS, CHUNK, dk), bf), tile((BUFFERS, CHUNK, dk), bf), tile((BUFFERS, CHUNK, CHUNK), bf),
        tile((BUFFERS, CHUNK, CHUNK), bf), tile((BUFFERS, 5, CHUNK), f32, False), tile((BUFFERS, CHUNK, bv), bf),
        tile((bv, dk), bf), tile((bv, CHUNK), bf), tile((bv, CHUNK), bf), tile((CHUNK, bv), o_ref.dtype, False),
        plgpu.Barrier(num_barriers=BUFFERS * len(SHARED)), plgpu.Barrier(num_barriers=BUFFERS),
    )


def applies(total, dk, dv, starts_aligned, dtype=jnp.bfloat16):
    """Whether scan() takes these inputs: bf16 (its products are bf16 ones: fp32 models keep the Triton scan's
    tf32x3), starts in whole 8-row tiles (its TMA copies into swizzled tiles need them), dk a multiple of 64, dv of
    32, total rows of 8."""
    return (jnp.dtype(dtype) == jnp.bfloat16 and bool(starts_aligned) and dk % 64 == 0 and dv % 32 == 0
            and total % 8 == 0)


def pick_bv(n_seq, hv, dv, cores=132):
    """V-block of the scan: 64 (half the programs of 32, each chunk's products no slower) once the programs of 64
    fill the SMs, else 32."""
    return 64 if dv % 64 == 0 and n_seq * hv * (dv // 64) >= cores else 32


def scan(q, k, v, t, p, f, pool, starts, lens, spans, slots, use_state, chunk_off, *, bv=None, interpret=False):
    """The T-form scan on packed sequences (gdn.wy_scan's contract): q, k [total, Hk, dk] and v [total, Hv, dv] raw
    bf16, starts multiples of 8; T and P [chunks, Hv, 64, 64] bf16, f [chunks, Hv, 5, 64] fp32 (gdn.wy_solve /
    gdn.wy_prep); pool [slots, Hv, dv, dk] fp32; chunk_off from gdn.chunk_map. bv: the V-block, 32 or 64 (None:
    pick_bv). Returns (o [total, Hv, dv] in v.dtype: rows [starts + lens, starts + spans) zero, rows outside every
    sequence unwritten; pool with each sequence's final state in its slot)."""
    total, hk, dk = k.shape
    hv, dv = v.shape[1:]
    n = starts.shape[0]
    bv = bv or pick_bv(n, hv, dv)
    if not all(x.dtype == jnp.bfloat16 for x in (q, k, v)):
        raise ValueError(f"the Mosaic GPU scan takes bf16 q, k, v, got {q.dtype}, {k.dtype}, {v.dtype}")
    if any(x.dtype != jnp.bfloat16 or x.shape[1:] != (hv, CHUNK, CHUNK) for x in (t, p)):
        raise ValueError(f"the Mosaic GPU scan takes T and P as bf16 [chunks, Hv, 64, 64], got T "
                         f"{t.dtype}{list(t.shape)}, P {p.dtype}{list(p.shape)}")
    if bv not in (32, 64) or dv % bv or dk % 64 or total % 8:
        raise ValueError(f"the Mosaic GPU scan needs a V-block of 32 or 64 dividing dv, dk a multiple of 64 and "
                         f"total rows of 8; got bv={bv}, dv={dv}, dk={dk}, total={total}")
    seq = jnp.stack([starts, lens, chunk_off, spans, slots, use_state]).astype(jnp.int32)
    pool_ref = jax.new_ref(pool)      # read and written in place by the kernel (an aliased input / output)
    o = plgpu.kernel(
        functools.partial(_scan_body, ratio=hv // hk, bv=bv),
        out_type=jax.ShapeDtypeStruct((total, hv, dv), v.dtype),
        grid=(n, hv, dv // bv), grid_names=("n", "h", "vb"),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(seq, q, k, v, t, p, f, pool_ref)
    return o, jax.ref.freeze(pool_ref)

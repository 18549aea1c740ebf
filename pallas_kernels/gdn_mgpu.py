"""The T-form GDN prefill scan as a Pallas Mosaic GPU kernel (Hopper: TMA loads, asynchronous wgmma).

Why: the Triton scan (gdn._wy_scan_kernel, tform) waits for every tensor-core product right after issuing it, one
4-warp program per SM, so each of its six products per chunk costs its whole latency (bench/RESULTS.md, 2026-12-01
readings). Here the chunk's inputs arrive by TMA a chunk ahead (two buffers; or one, reloaded tile by tile), the
products that do not depend on each other are issued together (K H with Q H; P Vnew with the state update), and T
and P arrive as bf16 hi + lo parts, ready tensor-core operands. The math of the Triton T-form scan, per chunk, with
the state H [dk, BV] fp32 in registers:

    Z = K H, Y = Q H                        bf16 products (H rounded to bf16, as h_prec "bf16")
    X = beta V - fw Z                       fp32, row factors from the prep (f rows 3, 4)
    Vnew = T X                              T and X each as bf16 hi + lo: three products (~tf32x3)
    O = fq Y + P Vnew                       P and Vnew likewise
    H = e^gamma_C H + K^T (fk Vnew)         fk Vnew as bf16 hi + lo: two products (as s_prec "bf16x2")

(X, Vnew and fk Vnew rounded to bf16 alone, one product each: v_parts=1.)

Inputs: those of the Triton T-form scan with T and P split, T [chunks, Hv, 2, 64, 64] bf16 (gdn.wy_solve
split=2), P likewise, f [chunks, Hv, 5, 64] fp32 (gdn.wy_prep pf_only, split=2); or T, P or both as hi alone
(split=1, WYConfig.t_parts / p_parts = 1: one product fewer each; the default's). The output goes by TMA straight
into its rows (out="direct", the default's; a tail chunk as power-of-two row pieces: TMA cannot mask rows and the rows
after a tail belong to the next sequence), or per chunk, [chunks, 64, Hv, dv], gathered to [total, Hv, dv] outside
(out="chunks": the same kernel time, plus the gather). Each program reads its initial state from its slot of the pool
and writes the final state back in place (the pool is a mutable ref: an aliased input / output), both in the pool's
[dv, dk] orientation through the WGMMA_TRANSPOSED register layout, one cheap shuffle away from the accumulator's;
the states used to travel as [N, Hv, dk, dv] with XLA's gather, transposes and scatter around the kernel (~5.6 of
71 us at 1x1k, bench/RESULTS.md).

Two options on the chain of dependent products (Z -> Vnew -> H -> the next chunk's Z, three rounds of products, each
behind a shared-memory store and a fence): wgs=2 runs two warpgroups per program, each its own V-block and chain on
shared tiles (measured slower at 1x8k, even at 8x2k: bench/RESULTS.md, "Readings of the 2026-12-02 evening H200
runs"); lookahead carries the next chunk's Z (two rounds per chunk; slower: 583.2 vs 477.1 us at 1x8k). defer_o
stores each chunk's output while the next chunk's first products run (no faster at 1x8k, slower at 1x32k). H200
figures: bench/RESULTS.md, "Readings of the 2026-12-02 late-morning H200 runs" and later readings (the whole-prefill
figures of out="chunks" up to c257dc4 leave its gather out: "Readings of the 2026-12-02 late-afternoon H200 runs").
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

CHUNK = 64          # = gdn.CHUNK (gdn imports this module)
SHARED = ("q", "k", "t", "p", "f")   # the tiles a program's warpgroups share: one TMA barrier each per buffer


def _swizzle(cols: int, dtype) -> tuple:
    """Tiling and swizzle transforms of a [rows, cols] shared-memory tile (the widest swizzle its rows allow)."""
    row_bytes = cols * jnp.dtype(dtype).itemsize
    swizzle = min(128, row_bytes)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def split_bf16(x):
    """fp32 -> (hi, lo) bf16 with hi + lo = x to ~2^-16 relative (also gdn's "bf16x2" products and split outputs)."""
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


def _store_split(refs, x):
    """x [K, N] fp32 -> its bf16 hi and lo parts, K-major, in refs[0] and refs[1]; or x rounded to bf16 in refs[0]
    where refs holds one tile (v_parts=1)."""
    if len(refs) == 1:
        _store_kmajor(refs[0], x)
        return
    hi, lo = split_bf16(x)
    _store_kmajor(refs[0], hi)
    _store_kmajor(refs[1], lo)


def _products(acc, a_parts, b_parts):
    """acc += A B from A's bf16 parts (a_parts [parts, M, K]: hi and lo, or hi alone) and B's (K-major: hi and lo,
    or hi alone): hi hi (+ hi lo) (+ lo hi). Returns the number of products issued (wgmma groups, for
    wgmma_accumulator_load)."""
    for b in b_parts:
        plgpu.wgmma(acc, a_parts.at[0], _b(b))
    if a_parts.shape[0] == 2:
        plgpu.wgmma(acc, a_parts.at[1], _b(b_parts[0]))
    return a_parts.shape[0] + len(b_parts) - 1


def _scan_body(seq_ref, q_ref, k_ref, v_ref, t_ref, p_ref, f_ref, pool_ref, o_ref, *, ratio, bv,
               buffers, chunked, wgs, lookahead, defer_o, v_parts):
    n, hv, vb = lax.axis_index("n"), lax.axis_index("h"), lax.axis_index("vb")
    wg = lax.axis_index("wg") if wgs > 1 else 0
    kh = lax.div(hv, jnp.int32(ratio))
    dk = q_ref.shape[-1]
    start, length, coff, span, slot, use = (seq_ref[i, n] for i in range(6))
    nch = lax.div(length + CHUNK - 1, jnp.int32(CHUNK))
    vcols = pl.ds(pl.multiple_of((vb * wgs + wg) * bv, bv), bv)
    wgl, wgt = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA_TRANSPOSED
    row = wgl.reduce(1)
    tile_acc = plgpu.ACC((CHUNK, bv), jnp.float32)

    def kernel(q_s, k_s, t_s, p_s, f_s, v_s, h_s, x_s, vk_s, o_s, bars, vbars, consumed=None, m_s=None, kbars=None):
        # this warpgroup's own tiles (v, the state and product operands, o); q, k, T, P, f are the program's
        v_s, h_s, o_s = v_s.at[wg], h_s.at[wg], o_s.at[wg]
        x_s, vk_s = [r.at[wg] for r in x_s], [r.at[wg] for r in vk_s]
        vbar = lambda slot: vbars.at[wg * buffers + slot]

        def store_rows(row, nrows):
            """o_s rows [0, nrows) (nrows <= 64) -> o rows [row, row + nrows) of this warpgroup's columns. TMA cannot
            mask rows and the rows after a tail chunk belong to the next sequence: a partial tile goes out as
            power-of-two pieces."""
            out = lambda r, m: o_ref.at[pl.ds(r, m), hv, vcols]
            pl.when(nrows == CHUNK)(lambda: plgpu.copy_smem_to_gmem(o_s, out(row, CHUNK)))

            @pl.when(nrows < CHUNK)
            def _():
                off = 0
                for m in (32, 16, 8, 4, 2, 1):
                    pl.when(lax.bitwise_and(nrows, m) != 0)(
                        lambda off=off, m=m: plgpu.copy_smem_to_gmem(o_s.at[pl.ds(off, m)], out(row + off, m)))
                    off = off + lax.bitwise_and(nrows, m)

        def fetch(c, slot, which=SHARED + ("v",)):
            """Chunk c's tiles `which` into buffer `slot`: the shared ones by warpgroup 0 (once warpgroup 1 is done
            with the buffer's previous chunk), v by each warpgroup for its own columns."""
            row0, cc = pl.multiple_of(start + c * CHUNK, 8), coff + c      # starts are multiples of 8: scan()
            srcs = dict(q=q_ref.at[pl.ds(row0, CHUNK), kh], k=k_ref.at[pl.ds(row0, CHUNK), kh], t=t_ref.at[cc, hv],
                        p=p_ref.at[cc, hv], f=f_ref.at[cc, hv])
            dsts = dict(q=q_s, k=k_s, t=t_s, p=p_s, f=f_s)
            if "v" in which:
                plgpu.copy_gmem_to_smem(v_ref.at[pl.ds(row0, CHUNK), hv, vcols], v_s.at[slot], vbar(slot))

            def shared():
                if consumed is not None:
                    pl.when(c >= buffers)(lambda: plgpu.barrier_wait(consumed.at[slot]))
                for name in which:
                    if name != "v":
                        i = SHARED.index(name)
                        plgpu.copy_gmem_to_smem(srcs[name], dsts[name].at[slot], bars.at[slot * len(SHARED) + i])
            pl.when(wg == 0)(shared) if wgs > 1 else shared()

        def fetch_k(c):                                         # lookahead: chunk c's keys into the ring of three
            kslot = lax.rem(c, 3)
            row0 = pl.multiple_of(start + c * CHUNK, 8)
            plgpu.copy_gmem_to_smem(k_ref.at[pl.ds(row0, CHUNK), kh], k_s.at[kslot], kbars.at[kslot])

        def refill(c, which):
            """One buffer: chunk c + 1's tiles `which` into the buffer as soon as chunk c is done with them."""
            if buffers == 1:
                pl.when(c + 1 < nch)(lambda: fetch(c + 1, 0, which))

        @pl.when(nch > 0)
        def _():
            fetch(0, 0, ("q", "t", "p", "f", "v") if lookahead else SHARED + ("v",))
            if lookahead:
                fetch_k(0)
                pl.when(nch > 1)(lambda: fetch_k(1))

        # the initial state H [dk, BV] fp32, read from the pool's [dv, dk] rows of its slot (a column of H is a row
        # there: each warp's loads still fill whole 32-byte sectors); zeros where the sequence starts fresh
        h_pool = lambda ref: ref.at[slot, hv, vcols, :].transpose((1, 0))
        h = lax.cond(use != 0,
                     lambda: plgpu.layout_cast(plgpu.load(h_pool(pool_ref), layout=wgt, optimized=False), wgl),
                     lambda: plgpu.layout_cast(jnp.zeros((dk, bv), jnp.float32), wgl))

        fd_at = lambda c: f_ref[coff + jnp.clip(c, 0, jnp.maximum(nch - 1, 0)), hv, 2, 0]   # a chunk's decay (HBM)

        def put_o(c, o, tail):
            """Chunk c's output tile o -> o_s -> o (a whole tile per chunk, or its rows; a tail's valid ones)."""
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)     # the previous chunk's output has left o_s
            o_s[...] = o.astype(o_s.dtype)
            plgpu.commit_smem()
            if chunked:                                         # whole tiles per chunk, gathered outside
                plgpu.copy_smem_to_gmem(o_s, o_ref.at[coff + c, :, hv, vcols])
            elif tail:                                          # the last, partial chunk: its valid rows only
                store_rows(start + c * CHUNK, length - c * CHUNK)
            else:
                plgpu.copy_smem_to_gmem(o_s, o_ref.at[pl.ds(start + c * CHUNK, CHUNK), hv, vcols])

        def wait_tiles(slot, names):
            """Wait for buffer slot's shared tiles `names` and this warpgroup's v tile."""
            for name in names:
                plgpu.barrier_wait(bars.at[slot * len(SHARED) + SHARED.index(name)])
            plgpu.barrier_wait(vbar(slot))

        def row_factors_and_v(slot):
            """fq, fk, fw, beta (f rows 0, 1, 3, 4; per-row factors) and the v tile in fp32, from buffer slot."""
            factors = [plgpu.load(f_s.at[slot].at[i], layout=row) for i in (0, 1, 3, 4)]
            return (*factors, plgpu.load(v_s.at[slot], layout=wgl).astype(jnp.float32))

        def chunk(c, carry, tail=False):
            h, fd = carry[:2]
            fd_next = fd_at(c + 1)                              # loaded a chunk ahead: off the critical path
            slot = lax.rem(c, jnp.int32(buffers))
            if buffers > 1:                                     # the next chunk's tiles while this one computes
                pl.when(c + 1 < nch)(lambda: fetch(c + 1, lax.rem(c + 1, jnp.int32(buffers))))

            wait_tiles(slot, SHARED)
            qs, ks, ts, ps = q_s.at[slot], k_s.at[slot], t_s.at[slot], p_s.at[slot]
            _store_kmajor(h_s, h)
            plgpu.commit_smem()

            def zy(z_acc, y_acc):                               # Z = K H and Y = Q H, issued together
                plgpu.wgmma(z_acc, ks, _b(h_s))
                plgpu.wgmma(y_acc, qs, _b(h_s))
                if defer_o:                                     # the previous chunk's output while they run
                    pl.when(c > 0)(lambda: put_o(c - 1, carry[2], False))
                return z_acc[...], y_acc[...]
            z, y = pl.run_scoped(zy, tile_acc, tile_acc)
            refill(c, ("q",))
            fq, fk, fw, beta, v = row_factors_and_v(slot)
            _store_split(x_s, _rows(beta, bv) * v - _rows(fw, bv) * z)
            plgpu.commit_smem()
            refill(c, ("v", "f"))

            def tx(acc):                                        # Vnew = T X, ~tf32x3 from bf16 parts
                _products(acc, ts, x_s)
                return acc[...]
            vnew = pl.run_scoped(tx, tile_acc)
            refill(c, ("t",))
            _store_split(x_s, vnew)                             # X is spent: its buffers take Vnew
            _store_split(vk_s, _rows(fk, bv) * vnew)
            plgpu.commit_smem()

            def pv_update(o_acc, h_acc):                        # the state update and P Vnew, issued together
                for part in vk_s:
                    plgpu.wgmma(h_acc, ks.transpose((1, 0)), _b(part))
                _products(o_acc, ps, x_s)
                return o_acc[...], h_acc[...]
            pv, upd = pl.run_scoped(pv_update, tile_acc, plgpu.ACC((dk, bv), jnp.float32))
            if consumed is not None:  # this warpgroup is done with the shared tiles (where the buffer is refilled)
                pl.when(c + buffers < nch)(lambda: plgpu.barrier_arrive(consumed.at[slot]))
            refill(c, ("k", "p"))
            o = _rows(fq, bv) * y + pv
            if defer_o:                                         # stored by the next chunk, or after the loop
                return fd * h + upd, fd_next, o.astype(o_s.dtype)
            put_o(c, o, tail)
            return fd * h + upd, fd_next

        def chunk_ahead(c, carry, tail=False):
            """lookahead: Z = K H arrives from the previous chunk as Z' = e^gamma_C K' H + M (fk Vnew) with
            M = K' K^T (K' the next chunk's keys), so the chain from one chunk's Z to the next one's is two rounds of
            products (T X, then M (fk Vnew)) instead of three (K H, T X, K^T (fk Vnew)). K comes in a ring of three
            buffers, a chunk further ahead than the rest (M needs the next chunk's keys)."""
            h, z, fd = carry
            fd_next = fd_at(c + 1)
            slot, ks_, kn_ = lax.rem(c, 2), lax.rem(c, 3), lax.rem(c + 1, 3)
            pl.when(c + 1 < nch)(lambda: fetch(c + 1, lax.rem(c + 1, 2), ("q", "t", "p", "f", "v")))
            pl.when(c + 2 < nch)(lambda: fetch_k(c + 2))
            wait_tiles(slot, ("q", "t", "p", "f"))
            pl.when(c + 1 < nch)(lambda: plgpu.barrier_wait(kbars.at[kn_]))
            # the last chunk's M and K' H read a stale key buffer: their results are not used
            qs, ks, kn, ts, ps = q_s.at[slot], k_s.at[ks_], k_s.at[kn_], t_s.at[slot], p_s.at[slot]
            fq, fk, fw, beta, v = row_factors_and_v(slot)

            def products(m_acc, vnew_acc, y_acc, a_acc, zn_acc, o_acc, h_acc):
                plgpu.wgmma(m_acc, kn, _b(ks))                  # M = K' K^T: keys only, ahead of the chain
                _store_split(x_s, _rows(beta, bv) * v - _rows(fw, bv) * z)
                _store_kmajor(h_s, h)
                plgpu.commit_smem()
                tx = _products(vnew_acc, ts, x_s)               # Vnew = T X (the chain), then Q H and K' H
                plgpu.wgmma(y_acc, qs, _b(h_s))
                plgpu.wgmma(a_acc, kn, _b(h_s))
                m_s[...] = plgpu.wgmma_accumulator_load(m_acc, wait_n=tx + 2).astype(m_s.dtype)
                vnew = plgpu.wgmma_accumulator_load(vnew_acc, wait_n=2)
                _store_split(x_s, vnew)                         # X is spent: its buffers take Vnew
                _store_split(vk_s, _rows(fk, bv) * vnew)
                plgpu.commit_smem()
                for part in vk_s:                               # M (fk Vnew) (the chain)
                    plgpu.wgmma(zn_acc, m_s, _b(part))
                for part in vk_s:                               # the state update, P Vnew
                    plgpu.wgmma(h_acc, ks.transpose((1, 0)), _b(part))
                pv = _products(o_acc, ps, x_s)
                zn = plgpu.wgmma_accumulator_load(zn_acc, wait_n=len(vk_s) + pv)
                z_next = fd * plgpu.wgmma_accumulator_load(a_acc, wait_n=None) + zn
                y = plgpu.wgmma_accumulator_load(y_acc, wait_n=None)
                return z_next, y, plgpu.wgmma_accumulator_load(o_acc), plgpu.wgmma_accumulator_load(h_acc)
            z_next, y, pv, upd = pl.run_scoped(products, plgpu.ACC((CHUNK, CHUNK), jnp.float32), tile_acc, tile_acc,
                                               tile_acc, tile_acc, tile_acc, plgpu.ACC((dk, bv), jnp.float32))
            put_o(c, _rows(fq, bv) * y + pv, tail)
            return fd * h + upd, z_next, fd_next

        # direct: the whole chunks in one loop (no conditional store in it), a partial last chunk in a loop of one
        full = nch if chunked else lax.div(length, jnp.int32(CHUNK))
        if lookahead:                                           # Z of the first chunk (an empty row: unused)
            pl.when(nch > 0)(lambda: plgpu.barrier_wait(kbars.at[0]))
            _store_kmajor(h_s, h)
            plgpu.commit_smem()

            def z0(acc):
                plgpu.wgmma(acc, k_s.at[0], _b(h_s))
                return acc[...]
            carry, step = (h, pl.run_scoped(z0, tile_acc), fd_at(0)), chunk_ahead
        else:
            carry, step = (h, fd_at(0)), chunk
        if defer_o:           # every chunk stores its predecessor's output, a whole one; the last one's goes out here
            carry = lax.fori_loop(0, nch, step, carry + (plgpu.layout_cast(jnp.zeros((CHUNK, bv), o_s.dtype), wgl),))
            pl.when(nch > 0)(lambda: put_o(nch - 1, carry[2], True))     # direct: its valid rows
        else:
            carry = lax.fori_loop(0, full, step, carry)
            if not chunked:
                carry = lax.fori_loop(full, nch, functools.partial(step, tail=True), carry)
        h = carry[0]
        h_pool(pool_ref)[...] = plgpu.layout_cast(h, wgt)        # the final state, in place in its slot

        def zero_padding():                                     # direct: rows [len, span) (a padded batch's)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            o_s[...] = jnp.zeros((CHUNK, bv), o_s.dtype)
            plgpu.commit_smem()
            pad, row = span - length, start + length
            lax.fori_loop(0, lax.div(pad, jnp.int32(CHUNK)),
                          lambda i, _: store_rows(row + i * CHUNK, jnp.int32(CHUNK)), None)
            store_rows(row + pad - lax.rem(pad, jnp.int32(CHUNK)), lax.rem(pad, jnp.int32(CHUNK)))

        if not chunked:
            pl.when(span > length)(zero_padding)
        plgpu.wait_smem_to_gmem(0)

    bf, f32 = jnp.bfloat16, jnp.float32
    tile = lambda shape, dtype, swz=True: plgpu.SMEM(shape, dtype,
                                                     transforms=_swizzle(shape[-1], dtype) if swz else ())
    pair = lambda rows, cols: [tile((wgs, rows, cols), bf) for _ in range(v_parts)]   # B operands, K-major
    pl.run_scoped(
        kernel,
        tile((buffers, CHUNK, dk), bf), tile((3 if lookahead else buffers, CHUNK, dk), bf),
        tile((buffers,) + t_ref.shape[2:], bf), tile((buffers,) + p_ref.shape[2:], bf),
        tile((buffers, 5, CHUNK), f32, False), tile((wgs, buffers, CHUNK, bv), bf),
        tile((wgs, bv, dk), bf), pair(bv, CHUNK), pair(bv, CHUNK), tile((wgs, CHUNK, bv), o_ref.dtype, False),
        plgpu.Barrier(num_barriers=buffers * len(SHARED)), plgpu.Barrier(num_barriers=wgs * buffers),
        **(dict(consumed=plgpu.Barrier(num_arrivals=wgs, num_barriers=buffers)) if wgs > 1 else {}),
        **(dict(m_s=tile((CHUNK, CHUNK), bf), kbars=plgpu.Barrier(num_barriers=3)) if lookahead else {}),
        **(dict(collective_axes="wg") if wgs > 1 else {}),    # one allocation for the program's warpgroups
    )

def applies(total, dk, dv, starts_aligned, dtype=jnp.bfloat16):
    """Whether scan() takes these inputs: bf16 (its products are bf16 ones: fp32 models keep the Triton scan's
    tf32x3), starts in whole 8-row tiles (its TMA copies into swizzled tiles need them), dk a multiple of 64, dv of
    32, total rows of 8."""
    return (jnp.dtype(dtype) == jnp.bfloat16 and bool(starts_aligned) and dk % 64 == 0 and dv % 32 == 0
            and total % 8 == 0)


def pick_bv(n_seq, hv, dv, cores=132, wgs=1):
    """V-block of the scan: 64 (half the programs of 32, each chunk's products no slower) once the programs of 64
    fill the SMs, else 32. Two warpgroups: 32 each once programs of 64 columns fill the SMs, else 16."""
    wide = 64 // wgs
    return wide if dv % (wide * wgs) == 0 and n_seq * hv * (dv // (wide * wgs)) >= cores else wide // 2


def scan(q, k, v, t, p, f, pool, starts, lens, spans, slots, use_state, chunk_off, *, bv=None, buffers=2,
         out="chunks", wgs=1, lookahead=False, defer_o=False, v_parts=2, row0=None, nvalid=None, interpret=False):
    """The T-form scan on packed sequences (gdn.wy_scan's contract for config.tform): q, k [total, Hk, dk] and v
    [total, Hv, dv] raw bf16, starts multiples of 8; t / p / f from gdn.wy_solve / gdn.wy_prep(pf_only=True), T and
    P each with split=2 (bf16 hi + lo: three products each) or 1 (hi alone: two); pool [slots, Hv, dv, dk] fp32;
    chunk_off from gdn.chunk_map. bv: the V-block (None: pick_bv).
    buffers: 2, the next chunk's tiles load while a chunk computes; 1, each tile reloads as soon as the chunk is done
    with it (half the shared memory: two programs per SM at V-block 32). wgs: warpgroups per program, each its own
    V-block of bv columns (and its own chain of dependent products) on the q, k, T, P, f tiles they share (loaded
    once, by warpgroup 0, after both are done with the buffer's previous chunk); 2 needs 2 buffers. lookahead: the
    next chunk's K H from this chunk's (two rounds of products on the chain per chunk instead of three; one
    warpgroup, 2 buffers, V-block 16 or 32: _scan_body's chunk_ahead). defer_o: each chunk's output tile is stored by
    the next chunk while its K H and Q H run (off the chain of dependent products), the last one's after the loop; not
    with lookahead. v_parts: the operands the kernel forms per chunk in fp32 (X for T X, Vnew for P Vnew, fk Vnew
    for the state update) as bf16 hi + lo (2: two products each) or rounded to bf16 (1: one product each, three
    products and three shared-memory tile stores fewer per chunk on the chain; fla's bf16 v_new). out: "chunks",
    whole [64, bv] tiles per chunk gathered into rows by XLA afterwards (row0 and nvalid from gdn.chunk_map; every
    row outside a sequence zero); "direct", o by TMA straight into its rows, the
    whole chunks in one loop and a partial last chunk after it (H200, d61f829: the scan kernel's time as with
    "chunks", the whole prefill 457.9 vs 501.6 us at 1x8k). Returns (o [total, Hv, dv] in v.dtype: rows [starts +
    lens, starts + spans) zero, rows outside every sequence unwritten; pool with each sequence's final state in its
    slot)."""
    total, hk, dk = k.shape
    hv, dv = v.shape[1:]
    n = starts.shape[0]
    bv = bv or min(pick_bv(n, hv, dv, wgs=wgs), 32 if lookahead else 64)
    if not all(x.dtype == jnp.bfloat16 for x in (q, k, v)):
        raise ValueError(f"the Mosaic GPU scan takes bf16 q, k, v, got {q.dtype}, {k.dtype}, {v.dtype}")
    if any(x.dtype != jnp.bfloat16 or x.ndim != 5 or x.shape[2] not in (1, 2) for x in (t, p)) or (
            t.shape[:2] + t.shape[3:] != p.shape[:2] + p.shape[3:]):
        raise ValueError(f"the Mosaic GPU scan takes T and P as bf16 parts [chunks, Hv, 1 or 2, 64, 64] (wy_solve / "
                         f"wy_prep split=1 or 2), got T {t.dtype}{list(t.shape)}, P {p.dtype}{list(p.shape)}")
    if buffers not in (1, 2) or wgs not in (1, 2) or (wgs == 2 and buffers != 2):
        raise ValueError(f"the Mosaic GPU scan takes 1 or 2 buffers and 1 or 2 warpgroups (2 with 2 buffers), got "
                         f"buffers={buffers}, wgs={wgs}")
    if defer_o and lookahead:
        raise ValueError("the Mosaic GPU scan defers the output store (defer_o) on the plain chunk step, not lookahead")
    if lookahead and (wgs != 1 or buffers != 2 or bv > 32):
        raise ValueError(f"the Mosaic GPU scan's lookahead takes one warpgroup, 2 buffers and a V-block of 16 or 32, "
                         f"got wgs={wgs}, buffers={buffers}, bv={bv}")
    if bv not in (16, 32, 64) or dv % (bv * wgs) or dk % 64 or total % 8:
        raise ValueError(f"the Mosaic GPU scan needs a V-block of 16, 32 or 64 (times wgs) dividing dv, dk a multiple "
                         f"of 64 and total rows of 8; got bv={bv}, wgs={wgs}, dv={dv}, dk={dk}, total={total}")
    if v_parts not in (1, 2):
        raise ValueError(f"the Mosaic GPU scan's v_parts is 1 or 2, got {v_parts}")
    if out not in ("direct", "chunks"):
        raise ValueError(f"the Mosaic GPU scan's out is 'direct' or 'chunks', got {out!r}")
    chunked, mc, i32 = out == "chunks", t.shape[0], jnp.int32
    seq = jnp.stack([starts, lens, chunk_off, spans, slots, use_state]).astype(i32)
    pool_ref = jax.new_ref(pool)      # read and written in place by the kernel (an aliased input / output)
    o = plgpu.kernel(
        functools.partial(_scan_body, ratio=hv // hk, bv=bv, buffers=buffers, chunked=chunked, wgs=wgs,
                          lookahead=lookahead, defer_o=defer_o, v_parts=v_parts),
        out_type=jax.ShapeDtypeStruct((mc, CHUNK, hv, dv) if chunked else (total, hv, dv), v.dtype),
        grid=(n, hv, dv // (bv * wgs)), grid_names=("n", "h", "vb"),
        num_threads=wgs if wgs > 1 else None, thread_name="wg" if wgs > 1 else None,
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(seq, q, k, v, t, p, f, pool_ref)
    if chunked:           # chunk c's row j is token row0[c] + j (where j < nvalid[c]): gather each token's row
        cid = jnp.arange(mc * CHUNK, dtype=i32).reshape(mc, CHUNK)
        j = jnp.arange(CHUNK, dtype=i32)[None, :]
        tok = jnp.where(j < nvalid[:, None], row0[:, None] + j, total)
        src = jnp.full((total,), mc * CHUNK, i32).at[tok.reshape(-1)].set(cid.reshape(-1), mode="drop")
        o = jnp.concatenate([o.reshape(mc * CHUNK, hv, dv), jnp.zeros((1, hv, dv), v.dtype)])[src]
    return o, jax.ref.freeze(pool_ref)

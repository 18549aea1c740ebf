"""Pallas (Triton) kernels of the gated delta rule: chunked prefill and the in-place decode step.

Contract: pallas_kernels/gdn_reference.py (the pure-jnp oracle beside this file). State pool fp32, V-first
[slots, Hv, dv, dk]; value head hv reads key head hv // (Hv // Hk); gates, l2norm and the dk^-0.5 scale are
computed inside the kernels from the raw projections.

Prefill is two launches (gdn-kernels.md section 3 for the math):
1. `_solve_kernel`, fully parallel over (chunk, key head): builds A = strict_lower(beta K^ K^T * Gamma) per value
   head (K^ = l2-normalised k: the raw bf16 K K^T is exact on tensor cores, the norms are fp32 row factors) and
   writes T = (I + A)^-1 (64x64, fp32) by blocked forward substitution (four 16x16 diagonal blocks solved row by
   row in fp32, then merged with exact fp32 16x16 products, as fla does).
2. `_scan_kernel`, one program per (sequence, value head, V-block): the fp32 state block [BV, dk] stays in
   registers across chunks (never written per chunk); per chunk it computes Vnew = T (beta (v - e^gamma K H)),
   o = e^gamma Q H + (Q K^T * Gamma) Vnew and H <- e^gamma_C H + Vnew^T (e^(gamma_C - gamma) K).
   Only T (16 KiB per chunk and value head) round-trips through memory; W, U and per-chunk states never exist.
   q and k stay raw in registers; l2norm and the scale enter as fp32 row factors of the products.

Speed (bench/RESULTS.md, H200): correct and 2-9x more accurate than fla, but the scan is ~2.5x slower than fla's
four-kernel chain: each 64-token chunk costs one program ~10 us, serialised over 6 dependent products. Moving the
H-independent work (W, U, Q^ - P W, P U) into the parallel kernel would leave the scan fla's two products plus one.

Sequences are packed: tokens [total, H, d] with per-sequence start offsets and lengths; each starts from its
slot's state (zeros where use_state is False) and writes its final state back in place (input_output_aliases).
The padded-batch contract of the model (`gdn_prefill`) is the packed call with row n starting at n * T.

Dot precision (`prec`): "tf32" (fp32 operands on tensor cores, ~5e-4 relative per product; the default for
bf16 models), "tf32x3" (three TF32 products, near fp32; the default for fp32 models, whose logits must match the
reference closely), "ieee", or "bf16" (fla's operand precision; misses the issue's 4e-3 output bar). Interpret
mode (CPU) reproduces the operand rounding of "tf32" and "bf16" and computes the others in fp32.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

CHUNK = 64
SUB = 16            # diagonal-block size of the triangular solve
HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """Launch parameters of the prefill kernels. bv=None picks the V-block from the amount of parallel work."""
    bv: int | None = None
    num_warps: int = 4
    num_stages: int = 2
    solve_warps: int = 4
    solve_stages: int = 1
    prec: str | None = None         # scan-kernel dots; None: "tf32" for bf16 inputs, "tf32x3" for fp32 inputs
    solve_prec: str | None = None   # K K^T of fp32 inputs (bf16 inputs: exact bf16 products; merges: exact fp32)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    bv: int = 32
    num_warps: int = 2
    num_stages: int = 1


# ----------------------------------------------------------------------------------------------------------------
# In-kernel helpers (all traced inside the kernels; only ops the Triton lowering supports).


def _round_tf32(x):
    """fp32 -> the nearest TF32 value (10 mantissa bits, ties away, as cvt.rna.tf32.f32): interpret-mode emulation."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jax.lax.bitcast_convert_type((bits + 0x1000) & ~0x1FFF, jnp.float32)


def _mm(a, b, contract, prec, interpret):
    """2-D dot with fp32 accumulation. contract = (lhs axis, rhs axis)."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    if prec == "bf16":
        a, b, precision = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), None
    elif interpret and prec == "tf32":         # reproduce the GPU's operand rounding on the CPU
        a, b, precision = _round_tf32(a), _round_tf32(b), HIGHEST
    elif interpret or prec == "ieee":
        precision = HIGHEST
    elif prec == "tf32":
        precision = None                      # fp32 operands -> TF32 tensor cores in the Triton lowering
    elif prec == "tf32x3":
        precision = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    else:
        raise ValueError(f"unknown dot precision {prec!r}")
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _l2norm(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _gates(a, b, a_log, dt_bias):
    """fp32 log decay g <= 0 and beta = sigmoid(b), as gdn_reference.gates."""
    g = -jnp.exp(a_log) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias)
    return g, jax.nn.sigmoid(b.astype(jnp.float32))


def _load(ref, mask, other=0.0):
    return pltriton.load(ref, mask=mask, other=other)


def _inv_unit_lower(blocks):
    """(I + a)^-1 for each strictly lower [16,16] fp32 block a, by forward substitution (exact fp32, like fla);
    one loop over rows updates all blocks (independent chains)."""
    n = blocks[0].shape[0]
    rows = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
    cols1 = jax.lax.broadcasted_iota(jnp.int32, (n,), 0)

    def row(i, invs):
        out = []
        for a, inv in zip(blocks, invs):
            r = jnp.sum(jnp.where(rows == i, -a, 0.0), axis=0)
            r = jnp.where(cols1 < i, r, 0.0)
            r = r + jnp.sum(r[:, None] * inv, axis=0)
            out.append(jnp.where(rows == i, r[None, :], inv))
        return tuple(out)

    invs = jax.lax.fori_loop(2, n, row, tuple(-a for a in blocks))
    eye = (rows == jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)).astype(jnp.float32)
    return [inv + eye for inv in invs]


# ----------------------------------------------------------------------------------------------------------------
# Kernel 1: T = (I + A)^-1 per (chunk, value head).


def _solve_kernel(row0_ref, nvalid_ref, k_ref, a_ref, b_ref, alog_ref, dtb_ref, t_ref, *, ratio, prec, interpret):
    c, kh = pl.program_id(0), pl.program_id(1)
    nvalid = nvalid_ref[c]

    @pl.when(nvalid > 0)
    def _():
        row0 = row0_ref[c]
        dk = k_ref.shape[-1]
        mm = functools.partial(_mm, interpret=interpret)
        exact = functools.partial(_mm, contract=(1, 0), prec="ieee", interpret=interpret)
        idx = jnp.arange(SUB, dtype=jnp.int32)
        nb = CHUNK // SUB
        ks, rks, valid = [], [], []
        for i in range(nb):
            v = idx + i * SUB < nvalid
            valid.append(v)
            x = _load(k_ref.at[pl.ds(row0 + i * SUB, SUB), kh, :], jnp.broadcast_to(v[:, None], (SUB, dk)))
            xf = x.astype(jnp.float32)
            ks.append(x)
            rks.append(jax.lax.rsqrt(jnp.sum(xf * xf, axis=1) + 1e-6))      # l2norm as row factors
        # raw K K^T: exact on bf16 tensor cores for bf16 inputs
        exact_prec = "bf16" if k_ref.dtype == jnp.bfloat16 else prec
        kk = {(i, j): mm(ks[i], ks[j], (1, 1), exact_prec) * (rks[i][:, None] * rks[j][None, :])
              for i in range(nb) for j in range(i + 1)}
        strict = idx[:, None] > idx[None, :]
        def per_head(r, carry):                              # the value heads sharing this key head
            hv = kh * ratio + r
            gs, betas = [], []
            for i in range(nb):
                av = _load(a_ref.at[pl.ds(row0 + i * SUB, SUB), hv], valid[i])
                bv = _load(b_ref.at[pl.ds(row0 + i * SUB, SUB), hv], valid[i])
                g, beta = _gates(av, bv, alog_ref[hv], dtb_ref[hv])
                gs.append(jnp.where(valid[i], g, 0.0))
                betas.append(jnp.where(valid[i], beta, 0.0))
            gam, acc = [], 0.0                               # chunk-local cumulative log decay per sub-block
            for i in range(nb):
                cs = jnp.cumsum(gs[i]) + acc
                gam.append(cs)
                acc = jnp.min(cs)                            # = last entry: gamma is non-increasing
            blocks = {}
            for i in range(nb):
                for j in range(i + 1):
                    diff = gam[i][:, None] - gam[j][None, :]
                    if i == j:                               # mask before exp: i < j would overflow
                        blk = jnp.where(strict, betas[i][:, None] * kk[i, j] * jnp.exp(jnp.where(strict, diff, 0.0)),
                                        0.0)
                    else:
                        blk = betas[i][:, None] * kk[i, j] * jnp.exp(diff)
                    blocks[i, j] = blk
            inv = dict(zip([(i, i) for i in range(nb)], _inv_unit_lower([blocks[i, i] for i in range(nb)])))
            for d in range(1, nb):                           # block merge: T_ij = -T_ii sum_m A_im T_mj
                for j in range(nb - d):
                    i = j + d
                    s = exact(blocks[i, j], inv[j, j])
                    for m in range(j + 1, i):
                        s = s + exact(blocks[i, m], inv[m, j])
                    inv[i, j] = -exact(inv[i, i], s)
            zero = jnp.zeros((SUB, SUB), jnp.float32)
            for i in range(nb):
                for j in range(nb):
                    t_ref[c, hv, pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)] = inv[i, j] if j <= i else zero
            return carry

        jax.lax.fori_loop(0, ratio, per_head, 0)


# ----------------------------------------------------------------------------------------------------------------
# Kernel 2: the chunk scan with the state on chip.


def _scan_kernel(start_ref, len_ref, span_ref, slot_ref, use_ref, coff_ref, q_ref, k_ref, v_ref, a_ref, b_ref,
                 alog_ref, dtb_ref, t_ref, pool_ref, o_ref, pool_out_ref, *, ratio, bv, prec, interpret):
    # Q K^T of bf16 inputs is exact on bf16 tensor cores (fp32 accumulation); fp32 inputs use `prec`.
    exact_prec = "bf16" if q_ref.dtype == jnp.bfloat16 else prec
    n, hv, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kh = hv // ratio
    start, length, span = start_ref[n], len_ref[n], span_ref[n]
    slot, coff = slot_ref[n], coff_ref[n]
    dk = q_ref.shape[-1]
    scale = dk ** -0.5
    a_log, dt_bias = alog_ref[hv], dtb_ref[hv]
    mm = functools.partial(_mm, prec=prec, interpret=interpret)
    vcols = pl.ds(vb * bv, bv)
    rows = jnp.arange(CHUNK, dtype=jnp.int32)
    incl = rows[:, None] >= rows[None, :]

    h = pool_ref[slot, hv, vcols, :]
    h = jnp.where(use_ref[n] != 0, h, 0.0)

    def chunk(c, h):
        row0 = start + c * CHUNK
        nvalid = jnp.minimum(length - c * CHUNK, CHUNK)
        valid = rows < nvalid
        vk = jnp.broadcast_to(valid[:, None], (CHUNK, dk))
        # q, k stay raw (input dtype, half the registers of fp32); l2norm and scale act as fp32 row factors.
        qr = _load(q_ref.at[pl.ds(row0, CHUNK), kh, :], vk)
        kr = _load(k_ref.at[pl.ds(row0, CHUNK), kh, :], vk)
        qf, kf = qr.astype(jnp.float32), kr.astype(jnp.float32)
        rq = jax.lax.rsqrt(jnp.sum(qf * qf, axis=1) + 1e-6) * scale
        rk = jax.lax.rsqrt(jnp.sum(kf * kf, axis=1) + 1e-6)
        v = _load(v_ref.at[pl.ds(row0, CHUNK), hv, vcols], jnp.broadcast_to(valid[:, None], (CHUNK, bv)))
        g, beta = _gates(_load(a_ref.at[pl.ds(row0, CHUNK), hv], valid),
                         _load(b_ref.at[pl.ds(row0, CHUNK), hv], valid), a_log, dt_bias)
        g = jnp.where(valid, g, 0.0)                       # padding is inert: no decay, no write
        beta = jnp.where(valid, beta, 0.0)
        gam = jnp.cumsum(g)
        g_last = jnp.min(gam)                              # gamma at the last valid row (gamma non-increasing)
        eg = jnp.exp(gam)
        t = t_ref[coff + c, hv, :, :]
        kh_ = mm(kf, h, (1, 1))                            # [C, BV] = K H (H is V-first [BV, dk]), k unnormalised
        vnew = mm(t, beta[:, None] * (v.astype(jnp.float32) - (eg * rk)[:, None] * kh_), (1, 0))
        qh = mm(qf, h, (1, 1))
        p = _mm(qr, kr, (1, 1), exact_prec, interpret) * (rq[:, None] * rk[None, :])
        p = jnp.where(incl, p * jnp.exp(jnp.where(incl, gam[:, None] - gam[None, :], 0.0)), 0.0)
        o = (eg * rq)[:, None] * qh + mm(p, vnew, (1, 0))
        ostore = jnp.broadcast_to((rows < span - c * CHUNK)[:, None], (CHUNK, bv))
        pltriton.store(o_ref.at[pl.ds(row0, CHUNK), hv, vcols], o.astype(o_ref.dtype), mask=ostore)
        wgt = vnew * (jnp.exp(g_last - gam) * rk)[:, None]  # decay to the chunk end and k's norm, on Vnew's rows
        return jnp.exp(g_last) * h + mm(wgt, kf, (0, 0))

    nch = (length + CHUNK - 1) // CHUNK
    h = jax.lax.fori_loop(0, nch, chunk, h)

    def zero_chunk(c, carry):                              # rows [len, span): padding of a padded batch
        row0 = start + c * CHUNK
        m = jnp.broadcast_to((rows < span - c * CHUNK)[:, None], (CHUNK, bv))
        pltriton.store(o_ref.at[pl.ds(row0, CHUNK), hv, vcols], jnp.zeros((CHUNK, bv), o_ref.dtype), mask=m)
        return carry

    jax.lax.fori_loop(nch, (span + CHUNK - 1) // CHUNK, zero_chunk, 0)
    pool_out_ref[slot, hv, vcols, :] = h               # same buffer as pool_ref (aliased): in place


# ----------------------------------------------------------------------------------------------------------------
# Wrappers.


def _check_dims(dk, dv, hk, hv):
    for name, d in (("dk", dk), ("dv", dv)):
        if d < 16 or d & (d - 1):
            raise ValueError(f"GDN Pallas kernels need {name} a power of two >= 16, got {d}")
    if hv % hk:
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({hk})")


def pick_bv(n_seq, hv, dv, cores=132):
    """Largest V-block that still gives about two programs per SM; at least 32 (or dv)."""
    bv = dv
    while bv > 32 and n_seq * hv * (dv // bv) < 2 * cores:
        bv //= 2
    return min(bv, dv)


def solve_t(k, a, b, A_log, dt_bias, starts, lens, max_chunks, ratio, prec, config: PrefillConfig, interpret):
    """Kernel 1 of the prefill: T = (I + A)^-1 for every chunk of every sequence, [max_chunks, Hv, 64, 64] fp32.
    Returns (chunk_off [N]: the first flat chunk of each sequence, T)."""
    n = starts.shape[0]
    hk, hv = k.shape[1], a.shape[1]
    nch = (lens + CHUNK - 1) // CHUNK                    # flat chunk id -> (first row, valid rows)
    cum = jnp.cumsum(nch)
    chunk_off = (cum - nch).astype(jnp.int32)
    cid = jnp.arange(max_chunks, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(cum, cid, side="right"), n - 1).astype(jnp.int32)
    local = cid - chunk_off[seq]
    row0 = starts[seq] + local * CHUNK
    nvalid = jnp.where(cid < cum[-1], jnp.clip(lens[seq] - local * CHUNK, 0, CHUNK), 0).astype(jnp.int32)
    tmat = pl.pallas_call(
        functools.partial(_solve_kernel, ratio=ratio, prec=prec, interpret=interpret),
        out_shape=jax.ShapeDtypeStruct((max_chunks, hv, CHUNK, CHUNK), jnp.float32),
        grid=(max_chunks, hk),
        compiler_params=pltriton.CompilerParams(num_warps=config.solve_warps, num_stages=config.solve_stages),
        interpret=interpret, name="gdn_solve",
    )(row0, nvalid, k, a, b, A_log.astype(jnp.float32), dt_bias.astype(jnp.float32))
    return chunk_off, tmat


def gdn_prefill_packed(q, k, v, a, b, A_log, dt_bias, pool, starts, lens, slots, use_state, *, spans=None,
                       max_chunks=None, config: PrefillConfig = PrefillConfig(), interpret=False):
    """Packed prefill. q,k [total, Hk, dk]; v [total, Hv, dv]; a,b [total, Hv] raw; pool [slots, Hv, dv, dk] fp32.
    Sequence n is rows [starts[n], starts[n] + lens[n]) (disjoint ranges); it starts from pool[slots[n]] (zeros
    where use_state[n] is False) and its final state is written back there. Output rows [starts + lens,
    starts + spans) are zeroed (spans default to lens); rows outside every sequence are left unwritten.
    max_chunks: static bound on sum(ceil(lens / 64)) (default ceil(total / 64) + N).
    Returns (o [total, Hv, dv] in v.dtype, pool)."""
    total, hk, dk = k.shape
    hv, dv = v.shape[-2:]
    _check_dims(dk, dv, hk, hv)
    if pool.dtype != jnp.float32:
        raise ValueError(f"the GDN state pool must be float32, got {pool.dtype}")
    n = starts.shape[0]
    ratio = hv // hk
    bv = config.bv or pick_bv(n, hv, dv)
    auto = "tf32x3" if v.dtype == jnp.float32 else "tf32"
    prec, solve_prec = config.prec or auto, config.solve_prec or auto
    if dv % bv or bv < 16:
        raise ValueError(f"V-block {bv} must divide dv={dv} and be >= 16")
    i32 = lambda x: jnp.asarray(x).astype(jnp.int32)
    starts, lens, slots = i32(starts), i32(lens), i32(slots)
    spans = lens if spans is None else i32(spans)
    use_state = i32(use_state)
    max_chunks = max_chunks or (-(-total // CHUNK) + n)

    chunk_off, tmat = solve_t(k, a, b, A_log, dt_bias, starts, lens, max_chunks, ratio, solve_prec, config, interpret)
    a_log, dtb = A_log.astype(jnp.float32), dt_bias.astype(jnp.float32)
    o, pool = pl.pallas_call(
        functools.partial(_scan_kernel, ratio=ratio, bv=bv, prec=prec, interpret=interpret),
        out_shape=(jax.ShapeDtypeStruct((total, hv, dv), v.dtype), jax.ShapeDtypeStruct(pool.shape, pool.dtype)),
        grid=(n, hv, dv // bv),
        input_output_aliases={14: 1},
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret, name="gdn_scan",
    )(starts, lens, spans, slots, use_state, chunk_off, q, k, v, a, b, a_log, dtb, tmat, pool)
    return o, pool


def gdn_prefill(q, k, v, a, b, A_log, dt_bias, pool, slots, lens, use_state, *,
                config: PrefillConfig = PrefillConfig(), interpret=False):
    """The model's padded-batch contract (gdn_reference.gdn_prefill): row n holds lens[n] real tokens of T."""
    n, t = q.shape[:2]
    flat = lambda x: x.reshape(n * t, *x.shape[2:])
    starts = jnp.arange(n, dtype=jnp.int32) * t
    o, pool = gdn_prefill_packed(flat(q), flat(k), flat(v), flat(a), flat(b), A_log, dt_bias, pool, starts, lens,
                                 slots, use_state, spans=jnp.full((n,), t, jnp.int32),
                                 max_chunks=n * (-(-t // CHUNK)), config=config, interpret=interpret)
    return o.reshape(n, t, *o.shape[1:]), pool


# ----------------------------------------------------------------------------------------------------------------
# Decode: one token per row, the state updated in place in the pool.


def _decode_kernel(slot_ref, q_ref, k_ref, v_ref, a_ref, b_ref, alog_ref, dtb_ref, pool_ref, o_ref, pool_out_ref,
                   *, ratio, bv):
    n, hv, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kh = hv // ratio
    slot = slot_ref[n]
    vcols = pl.ds(vb * bv, bv)
    dk = q_ref.shape[-1]
    q = _l2norm(q_ref[n, kh, :].astype(jnp.float32)) * (dk ** -0.5)
    k = _l2norm(k_ref[n, kh, :].astype(jnp.float32))
    v = v_ref[n, hv, vcols].astype(jnp.float32)
    g, beta = _gates(a_ref[n, hv], b_ref[n, hv], alog_ref[hv], dtb_ref[hv])
    alpha = jnp.exp(g)
    s = pool_ref[slot, hv, vcols, :]                                    # [BV, dk] fp32, contiguous dk
    r_k = jnp.sum(s * k[None, :], axis=1)
    r_q = jnp.sum(s * q[None, :], axis=1)
    u = beta * (v - alpha * r_k)
    o = alpha * r_q + jnp.sum(q * k) * u
    pool_out_ref[slot, hv, vcols, :] = alpha * s + u[:, None] * k[None, :]     # aliased: in place
    o_ref[n, hv, vcols] = o.astype(o_ref.dtype)


def gdn_decode(q, k, v, a, b, A_log, dt_bias, pool, slots, *, config: DecodeConfig = DecodeConfig(),
               interpret=False):
    """One token per row (q,k [N,Hk,dk], v [N,Hv,dv], a,b [N,Hv]); padded rows must use the null slot 0."""
    n, hk, dk = k.shape
    hv, dv = v.shape[-2:]
    _check_dims(dk, dv, hk, hv)
    if pool.dtype != jnp.float32:
        raise ValueError(f"the GDN state pool must be float32, got {pool.dtype}")
    bv = min(config.bv, dv)
    o, pool = pl.pallas_call(
        functools.partial(_decode_kernel, ratio=hv // hk, bv=bv),
        out_shape=(jax.ShapeDtypeStruct((n, hv, dv), v.dtype), jax.ShapeDtypeStruct(pool.shape, pool.dtype)),
        grid=(n, hv, dv // bv),
        input_output_aliases={8: 1},
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret, name="gdn_decode",
    )(jnp.asarray(slots).astype(jnp.int32), q, k, v, a, b, A_log.astype(jnp.float32), dt_bias.astype(jnp.float32),
      pool)
    return o, pool

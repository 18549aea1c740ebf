"""Pallas kernels of the gated delta rule (Triton; the prefill scan also in Mosaic GPU): chunked prefill and the
in-place decode step. docs/kernels.md describes the pipeline, its layouts, grids and tuned constants.

Contract: pallas_kernels/gdn_reference.py (the pure-jnp oracle beside this file). State pool fp32, V-first
[slots, Hv, dv, dk]; value head hv reads key head hv // (Hv // Hk); gates, l2norm and the dk^-0.5 scale are
computed inside the kernels from the raw projections. Slot 0 is the null slot: padded decode rows use it.

Prefill (`gdn_prefill_packed`, 64-token chunks): everything that does not depend on the running state is computed by
fully parallel kernels, so the sequential scan does the minimum per chunk.
1. T = (I + A)^-1 per (chunk, value head), A = strict_lower(beta K^ K^T * Gamma), and P = Q^ K^T * Gamma (causal incl.
   the diagonal) with the row factors f = (e^gamma |q|^-1 dk^-0.5, e^(gamma_C - gamma) |k|^-1, e^gamma_C,
   beta e^gamma |k|^-1, beta). Either by one fused kernel per (chunk, value head) (T by recursive doubling on the
   whole [64, 64] tile, `_doubling_inverse`), or by the T solve (`_solve_kernel`: 16x16 diagonal blocks by forward
   substitution, merged) followed by a P / f kernel per (chunk, key head). `resolve_prep` picks the fused kernel
   while its programs fit in one wave (FUSED_PREP_PROGRAMS; bf16 inputs only), the solve + P / f kernels otherwise.
2. The scan, one program per (sequence, value head, V-block) with the fp32 state H^T [dk, BV] on chip:
     Z = K H, Y = Q H                      (raw k, q; H rounded to bf16 for bf16 inputs)
     Vnew = T (beta V - fw * Z)
     o = fq * Y + P Vnew
     H <- e^gamma_C H + K^T (fk * Vnew)
   as a Mosaic GPU kernel (gdn_mgpu.py; T and P then bf16 tiles) wherever `gdn_mgpu.applies` (bf16, starts in whole
   8-row tiles, dk % 64, dv % 32), else as the Triton kernel `_scan_kernel` (T and P fp32): fp32 models, unaligned
   starts, small head dims, and the CPU tests of those shapes.

Sequences are packed: tokens [total, H, d] with per-sequence start offsets and lengths; each starts from its
slot's state (zeros where use_state is False) and writes its final state back in place. The padded-batch contract
of the model (`gdn_prefill`) is the packed call with row n starting at n * T.

Dot precisions ("bf16"; "bf16x2" = a bf16 hi + lo split of the fp32 operand against an exact bf16 operand; "tf32";
"tf32x3"): bf16 inputs take the bf16 / TF32 products of `_precisions`, fp32 inputs "tf32x3" everywhere (their logits
must match the reference closely); interpret mode (CPU) reproduces the operand rounding of "bf16", "bf16x2" and
"tf32" and computes "tf32x3" in fp32.

Decode (`gdn_decode_packed`): one program per (V-block, value head, row), the state updated in place.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import gdn_mgpu

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

CHUNK = 64          # tokens per chunk: T, P are [64, 64] tiles (one tensor-core tile edge); the scan's step
SUB = 16            # diagonal-block size of the T solve's forward substitution
HIGHEST = jax.lax.Precision.HIGHEST
FUSED_PREP_PROGRAMS = 2 * 132     # prep_mode "auto": the fused prep while its (chunk, value head) programs run in one
                                  # wave on the H200 (2 per SM at 4 warps); past that its doubling products cost more
                                  # than the solve's substitutions
SOLVE_WAVE_PROGRAMS = 8 * 132     # solve_grid "auto": the T solve per value head (half the chain per program) while
                                  # its 1-warp programs (8 per SM) run in one wave, else per key head


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """The prefill pipeline's tiles and launch parameters (module docstring, docs/kernels.md).
    bv, num_warps, num_stages: the Triton scan's V-block, warps and pipeline depth (None: pick_stages).
    mgpu_bv: the Mosaic GPU scan's V-block, 32 or 64 (None: gdn_mgpu.pick_bv).
    prep_warps: the fused T / P / f kernel's warps; solve_warps: the T solve's; pf_warps: the P / f kernel's.
    prep_mode: "auto" | "fused" | "solve2" (the T solve, then P / f per key head): resolve_prep.
    solve_grid: the T solve's grid, "auto" | "key" (chunk, key head) | "value" (chunk, value head): resolve_prep.
    mgpu: the Mosaic GPU scan wherever gdn_mgpu.applies (False: the Triton scan everywhere)."""
    bv: int = 32
    num_warps: int = 4
    num_stages: int | None = None
    mgpu_bv: int | None = None
    prep_warps: int = 4
    solve_warps: int = 1
    pf_warps: int = 2
    prep_mode: str = "auto"
    solve_grid: str = "auto"
    mgpu: bool = True

    @property
    def name(self):
        return (f"prefill_bv{self.bv}_w{self.num_warps}_s{self.num_stages or 'auto'}"
                + ("" if self.mgpu_bv is None else f"_mbv{self.mgpu_bv}") + ("" if self.mgpu else "_triton")
                + f"_pw{self.prep_warps}_sw{self.solve_warps}_pfw{self.pf_warps}"
                + ("" if self.prep_mode == "auto" else f"_{self.prep_mode}")
                + ("" if self.solve_grid == "auto" else f"_sg{self.solve_grid}"))


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """bv: V-rows of the state per program ([bv, dk] fp32 on num_warps warps; 8 on one warp, fla's decode tile)."""
    bv: int = 8
    num_warps: int = 1
    num_stages: int = 1

    @property
    def name(self):
        return f"bv{self.bv}_w{self.num_warps}" + (f"_s{self.num_stages}" if self.num_stages > 1 else "")


DEFAULT_PREFILL = PrefillConfig()
DEFAULT_DECODE = DecodeConfig()


def _precisions(dtype):
    """(Z, Y products; P Vnew; the state update; prep products and T (beta V - ..); the T solve's merges / the fused
    prep's doubling) for bf16 or fp32 inputs."""
    if jnp.dtype(dtype) == jnp.float32:
        return ("tf32x3",) * 5
    return "bf16", "tf32", "bf16x2", "tf32", "tf32"


def resolve_prep(config: PrefillConfig, max_chunks: int, hv: int, dtype) -> PrefillConfig:
    """prep_mode "auto": T, P and f from the fused kernel while its (chunk, value head) programs fit in
    FUSED_PREP_PROGRAMS on bf16 inputs, else T from the solve kernel and P, f per key head ("solve2"). solve_grid
    "auto": the solve per value head while its (chunk, value head) programs fit in SOLVE_WAVE_PROGRAMS, else per key
    head. Returns the config with both resolved."""
    if config.solve_grid not in ("key", "value", "auto"):
        raise ValueError(f"PrefillConfig.solve_grid must be 'key', 'value' or 'auto', got {config.solve_grid!r}")
    if config.prep_mode not in ("fused", "solve2", "auto"):
        raise ValueError(f"PrefillConfig.prep_mode must be 'fused', 'solve2' or 'auto', got {config.prep_mode!r}")
    bf16 = jnp.dtype(dtype) == jnp.bfloat16
    if config.prep_mode == "fused" and not bf16:
        raise ValueError("prep_mode 'fused' takes bf16 inputs (fp32 ones keep the solve's tf32x3 merges)")
    if config.solve_grid == "auto":
        config = dataclasses.replace(config, solve_grid="value" if max_chunks * hv <= SOLVE_WAVE_PROGRAMS else "key")
    if config.prep_mode == "auto":
        fused = bf16 and max_chunks * hv <= FUSED_PREP_PROGRAMS
        config = dataclasses.replace(config, prep_mode="fused" if fused else "solve2")
    return config


def pick_stages(programs, cores=132):
    """Triton scan pipeline depth for num_stages=None: two stages while every program has an SM to itself (one long
    sequence: the deeper pipeline wins), one when there are more programs than SMs (smaller buffers let two
    programs share an SM)."""
    return 2 if programs <= cores else 1


# ----------------------------------------------------------------------------------------------------------------
# In-kernel helpers (all traced inside the kernels; only ops the Triton lowering supports).


def _round_tf32(x):
    """fp32 -> the nearest TF32 value (10 mantissa bits, ties away, as cvt.rna.tf32.f32): interpret-mode emulation."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jax.lax.bitcast_convert_type((bits + 0x1000) & ~0x1FFF, jnp.float32)


def _mm(a, b, contract, prec, interpret):
    """2-D dot with fp32 accumulation. contract = (lhs axis, rhs axis).
    "bf16x2": a is taken as bf16 (meant for an exact bf16 operand), b as a bf16 hi + lo pair (two dots)."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    dot = functools.partial(jax.lax.dot_general, dimension_numbers=dims, preferred_element_type=jnp.float32)
    if prec == "bf16":
        return dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16))
    if prec == "bf16x2":
        hi, lo = gdn_mgpu.split_bf16(b.astype(jnp.float32))
        a = a.astype(jnp.bfloat16)
        return dot(a, lo) + dot(a, hi)
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    if interpret and prec == "tf32":           # reproduce the GPU's operand rounding on the CPU
        a, b, precision = _round_tf32(a), _round_tf32(b), HIGHEST
    elif interpret:
        precision = HIGHEST
    elif prec == "tf32":
        precision = None                      # fp32 operands -> TF32 tensor cores in the Triton lowering
    elif prec == "tf32x3":
        precision = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    else:
        raise ValueError(f"unknown dot precision {prec!r}")
    return dot(a, b, precision=precision)


def _l2norm(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _gates(a, b, a_log, dt_bias):
    """fp32 log decay g <= 0 and beta = sigmoid(b), as gdn_reference.gates."""
    g = -jnp.exp(a_log) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias)
    return g, jax.nn.sigmoid(b.astype(jnp.float32))


def _load(ref, mask, other=0.0):
    return pltriton.load(ref, mask=mask, other=other)


def _store_tile(ref, lead, tile, x):
    """ref[lead + tile] = x in ref's dtype: fp32 for the Triton scan, bf16 for the Mosaic GPU scan's tensor-core
    operands."""
    ref[lead + tile] = x.astype(ref.dtype)


# ----------------------------------------------------------------------------------------------------------------
# The T solve: T = (I + A)^-1 from 16x16 blocks.


def _chunk_gates(a_ref, b_ref, row0, hv, valid, a_log, dt_bias):
    """Per 16-row block of a chunk: gates (zero on invalid rows: inert) and the chunk-local cumulative log decay.
    Returns (gammas, betas, gamma at the last valid row)."""
    gs, betas = [], []
    for i, vi in enumerate(valid):
        av = _load(a_ref.at[pl.ds(row0 + i * SUB, SUB), hv], vi)
        bv = _load(b_ref.at[pl.ds(row0 + i * SUB, SUB), hv], vi)
        g, beta = _gates(av, bv, a_log, dt_bias)
        gs.append(jnp.where(vi, g, 0.0))
        betas.append(jnp.where(vi, beta, 0.0))
    gam, acc = [], 0.0
    for g in gs:
        cs = jnp.cumsum(g) + acc
        gam.append(cs)
        acc = jnp.min(cs)                                    # = last entry: gamma is non-increasing
    return gam, betas, acc


def _k_blocks(k_ref, row0, kh, nvalid, raw, mm):
    """A chunk's raw k rows as four 16-row blocks (rows past nvalid read as 0), their l2norm row factors, the
    masks of valid rows and the blocks of K^ K^T {(i, j): [16, 16], j <= i} (raw: the precision of the raw
    products; bf16 inputs are exact on tensor cores)."""
    dk = k_ref.shape[-1]
    idx = jnp.arange(SUB, dtype=jnp.int32)
    ks, rks, valid = [], [], []
    for i in range(CHUNK // SUB):
        vi = idx + i * SUB < nvalid
        valid.append(vi)
        kx = _load(k_ref.at[pl.ds(row0 + i * SUB, SUB), kh, :], jnp.broadcast_to(vi[:, None], (SUB, dk)))
        kf = kx.astype(jnp.float32)
        ks.append(kx)
        rks.append(jax.lax.rsqrt(jnp.sum(kf * kf, axis=1) + 1e-6))          # l2norm as row factors
    kk = {(i, j): mm(ks[i], ks[j], (1, 1), raw) * (rks[i][:, None] * rks[j][None, :])
          for i in range(len(ks)) for j in range(i + 1)}
    return ks, rks, valid, kk


def _a_blocks(kk, gam, betas):
    """A = strict_lower(beta K^ K^T * Gamma) as 16x16 blocks {(i, j): block, j <= i} (kk: the blocks of K^ K^T)."""
    idx = jnp.arange(SUB, dtype=jnp.int32)
    strict = idx[:, None] > idx[None, :]
    blocks = {}
    for i in range(len(gam)):
        for j in range(i + 1):
            diff = gam[i][:, None] - gam[j][None, :]
            if i == j:                                       # mask before exp: i < j would overflow
                blocks[i, j] = jnp.where(
                    strict, betas[i][:, None] * kk[i, j] * jnp.exp(jnp.where(strict, diff, 0.0)), 0.0)
            else:
                blocks[i, j] = betas[i][:, None] * kk[i, j] * jnp.exp(diff)
    return blocks


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


def _merge_inverse(blocks, diag, interpret, prec):
    """T = (I + A)^-1 as blocks {(i, j): block, j <= i} from A's blocks and the inverses of its diagonal blocks,
    by the merge T_ij = -T_ii sum_m A_im T_mj (fla's scheme), its products in `prec`."""
    nb = len(diag)
    mm = functools.partial(_mm, contract=(1, 0), prec=prec, interpret=interpret)
    inv = {(i, i): diag[i] for i in range(nb)}
    for d in range(1, nb):
        for j in range(nb - d):
            i = j + d
            s = mm(blocks[i, j], inv[j, j])
            for m in range(j + 1, i):
                s = s + mm(blocks[i, m], inv[m, j])
            inv[i, j] = -mm(inv[i, i], s)
    return inv


def _solve_kernel(row0_ref, nvalid_ref, k_ref, a_ref, b_ref, alog_ref, dtb_ref, t_ref, *, ratio, prec, interpret,
                  inv_prec, per_value_head):
    """Grid (chunk, key head), the key head's value heads in a loop; per_value_head: grid (chunk, value head)."""
    c, h = pl.program_id(0), pl.program_id(1)
    kh, heads = (h // ratio, 1) if per_value_head else (h, ratio)
    nvalid = nvalid_ref[c]

    @pl.when(nvalid > 0)
    def _():
        row0 = row0_ref[c]
        mm = functools.partial(_mm, interpret=interpret)
        nb = CHUNK // SUB
        # raw K K^T: exact on bf16 tensor cores for bf16 inputs
        _, _, valid, kk = _k_blocks(k_ref, row0, kh, nvalid, "bf16" if k_ref.dtype == jnp.bfloat16 else prec, mm)

        def per_head(r, carry):                              # the value heads sharing this key head
            hv = h if per_value_head else kh * ratio + r
            gam, betas, _ = _chunk_gates(a_ref, b_ref, row0, hv, valid, alog_ref[hv], dtb_ref[hv])
            blocks = _a_blocks(kk, gam, betas)
            inv = _merge_inverse(blocks, _inv_unit_lower([blocks[i, i] for i in range(nb)]), interpret, inv_prec)
            zero = jnp.zeros((SUB, SUB), jnp.float32)
            for i in range(nb):
                for j in range(nb):
                    _store_tile(t_ref, (c, hv), (pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)),
                                inv[i, j] if j <= i else zero)
            return carry

        jax.lax.fori_loop(0, heads, per_head, 0)


# ----------------------------------------------------------------------------------------------------------------
# The P / f prep (and, fused, T by recursive doubling).


def _doubling_inverse(a, mm):
    """T = (I + A)^-1 of a strictly lower [64, 64] A on the whole tile, by recursive doubling: with X_b the inverse of
    I + A's diagonal blocks of size b, the blocks of size 2b are [[X0, 0], [-X1 C X0, X1]], i.e.
    X_2b = X_b - X_b (M_b X_b) where M_b keeps A's entries in the lower-left b x b quarter of each 2b block. Six steps
    from X_1 = I, two full-tile products each (mm: their precision); no power of A is formed, so nothing grows."""
    n = a.shape[0]
    idx = jnp.arange(n, dtype=jnp.int32)

    def step(s, x):                       # a loop, not unrolled: the six masked copies of A never live at once
        lower, upper = ((idx >> s) & 1) == 1, ((idx >> s) & 1) == 0
        quarter = ((idx >> (s + 1))[:, None] == (idx >> (s + 1))[None, :]) & lower[:, None] & upper[None, :]
        return x - mm(x, mm(jnp.where(quarter, a, 0.0), x))

    return jax.lax.fori_loop(0, n.bit_length() - 1, step, (idx[:, None] == idx[None, :]).astype(jnp.float32))


def _prep_kernel(row0_ref, nvalid_ref, q_ref, k_ref, a_ref, b_ref, alog_ref, dtb_ref, *refs, ratio, prec, interpret,
                 per_value_head, t_prec):
    """Grid (chunk, key head), the key head's `ratio` value heads in one program (q, k and Q K^T once), or
    per_value_head: grid (chunk, value head). Writes P [64, 64] and f [5, 64] = (fq, fk, e^gamma_C, fw, beta) per value
    head (refs = (p, f)); with refs = (t, p, f) also T, by `_doubling_inverse` on the whole tile from the k tile and
    the gates this kernel has anyway (its products in t_prec)."""
    t_ref, p_ref, f_ref = refs if len(refs) == 3 else (None, *refs)
    c, pid1 = pl.program_id(0), pl.program_id(1)
    kh = pid1 // ratio if per_value_head else pid1
    nvalid = nvalid_ref[c]

    @pl.when(nvalid > 0)
    def _():
        row0 = row0_ref[c]
        dk = k_ref.shape[-1]
        scale = dk ** -0.5
        mm = functools.partial(_mm, interpret=interpret)
        rows = jnp.arange(CHUNK, dtype=jnp.int32)
        incl = rows[:, None] >= rows[None, :]
        valid64 = rows < nvalid
        raw = "bf16" if k_ref.dtype == jnp.bfloat16 else prec  # raw bf16 products are exact on tensor cores
        full = jnp.broadcast_to(valid64[:, None], (CHUNK, dk))
        kt = _load(k_ref.at[pl.ds(row0, CHUNK), kh, :], full)
        qt = _load(q_ref.at[pl.ds(row0, CHUNK), kh, :], full)
        rk = jax.lax.rsqrt(jnp.sum(jnp.square(kt.astype(jnp.float32)), axis=1) + 1e-6)
        rq = jax.lax.rsqrt(jnp.sum(jnp.square(qt.astype(jnp.float32)), axis=1) + 1e-6) * scale
        qk = mm(qt, kt, (1, 1), raw) * (rq[:, None] * rk[None, :])
        # fused: K^ K^T here too, so that the q and k tiles die now (exact bf16 products for bf16 inputs)
        kk = None if t_ref is None else mm(kt, kt, (1, 1), raw) * (rk[:, None] * rk[None, :])
        heads = [pid1] if per_value_head else [kh * ratio + r for r in range(ratio)]
        gates = []
        for hv in heads:
            a_log, dt_bias = alog_ref[hv], dtb_ref[hv]
            g, beta = _gates(_load(a_ref.at[pl.ds(row0, CHUNK), hv], valid64),
                             _load(b_ref.at[pl.ds(row0, CHUNK), hv], valid64), a_log, dt_bias)
            gam, beta = jnp.cumsum(jnp.where(valid64, g, 0.0)), jnp.where(valid64, beta, 0.0)
            g_last = jnp.min(gam)                            # gamma at the last valid row (non-increasing)
            gates.append((gam, beta))
            _store_tile(p_ref, (c, hv), (slice(None), slice(None)),
                        jnp.where(incl, qk * jnp.exp(jnp.where(incl, gam[:, None] - gam[None, :], 0.0)), 0.0))
            f_ref[c, hv, 0, :] = jnp.exp(gam) * rq
            f_ref[c, hv, 1, :] = jnp.where(valid64, jnp.exp(g_last - gam) * rk, 0.0)
            f_ref[c, hv, 2, :] = jnp.broadcast_to(jnp.exp(g_last), (CHUNK,))
            f_ref[c, hv, 3, :] = beta * jnp.exp(gam) * rk
            f_ref[c, hv, 4, :] = beta
        if t_ref is not None:                                # fused: T per head from K^ K^T
            strict = rows[:, None] > rows[None, :]
            tmm = functools.partial(mm, contract=(1, 0), prec=t_prec)
            for hv, (gam, beta) in zip(heads, gates):
                a = jnp.where(strict, beta[:, None] * kk * jnp.exp(jnp.where(strict, gam[:, None] - gam[None, :],
                                                                                  0.0)), 0.0)
                _store_tile(t_ref, (c, hv), (slice(None), slice(None)), _doubling_inverse(a, tmm))


# ----------------------------------------------------------------------------------------------------------------
# The Triton scan (the fallback of the Mosaic GPU scan, gdn_mgpu.py).


def _scan_kernel(start_ref, len_ref, span_ref, slot_ref, use_ref, coff_ref, q_ref, k_ref, t_ref, v_ref, p_ref,
                 f_ref, pool_ref, o_ref, pool_out_ref, *, ratio, bv, precs, interpret):
    """Grid (sequence, value head, V-block): the fp32 state H^T [dk, BV] stays on chip across the chunks."""
    h_prec, o_prec, s_prec, t_prec = precs
    n, hv, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kh = hv // ratio
    start, length, span = start_ref[n], len_ref[n], span_ref[n]
    slot, coff = slot_ref[n], coff_ref[n]
    dk = q_ref.shape[-1]
    last_chunk = t_ref.shape[0] - 1
    mm = functools.partial(_mm, interpret=interpret)
    vcols = pl.ds(vb * bv, bv)
    rows = jnp.arange(CHUNK, dtype=jnp.int32)

    h = pool_ref[slot, hv, vcols, :]                         # [BV, dk], V-first as the pool
    h = jnp.where(use_ref[n] != 0, h, 0.0).T                 # -> [dk, BV]: every product below is a plain one
    nch = (length + CHUNK - 1) // CHUNK

    def fetch(c):
        """Chunk c's tiles: q, k, T, v, P."""
        row0 = start + c * CHUNK
        valid = (rows < length - c * CHUNK)[:, None]
        vk = jnp.broadcast_to(valid, (CHUNK, dk))
        cc = jnp.minimum(coff + c, last_chunk)               # in bounds even for an empty sequence's fetch
        return (_load(q_ref.at[pl.ds(row0, CHUNK), kh, :], vk), _load(k_ref.at[pl.ds(row0, CHUNK), kh, :], vk),
                t_ref[cc, hv, :, :],
                _load(v_ref.at[pl.ds(row0, CHUNK), hv, vcols], jnp.broadcast_to(valid, (CHUNK, bv))),
                p_ref[cc, hv, :, :])

    def factors(c):                                          # the row factors and the chunk's decay, a scalar
        cc = jnp.minimum(coff + jnp.minimum(c, nch - 1), last_chunk)
        return (f_ref[cc, hv, 0, :], f_ref[cc, hv, 1, :], f_ref[cc, hv, 2, 0], f_ref[cc, hv, 3, :],
                f_ref[cc, hv, 4, :])

    def body(c, carry):                                      # the row factors are loaded a chunk ahead (plain
        h, (fq, fk, fd, fw, beta) = carry                    # loads: the pipeliner leaves them synchronous)
        nxt = factors(c + 1)
        qr, kr, t, v, p = fetch(c)
        # Vnew = T (beta V - beta e^gamma |k|^-1 K H); both products of H issued before either is used
        z, y = mm(kr, h, (1, 0), h_prec), mm(qr, h, (1, 0), h_prec)
        vnew = mm(t, beta[:, None] * v.astype(jnp.float32) - fw[:, None] * z, (1, 0), t_prec)
        pv = mm(p, vnew, (1, 0), o_prec)
        upd = mm(kr, vnew * fk[:, None], (0, 0), s_prec)
        o = fq[:, None] * y + pv
        ostore = jnp.broadcast_to((rows < span - c * CHUNK)[:, None], (CHUNK, bv))
        pltriton.store(o_ref.at[pl.ds(start + c * CHUNK, CHUNK), hv, vcols], o.astype(o_ref.dtype), mask=ostore)
        return fd * h + upd, nxt

    h, _ = jax.lax.fori_loop(0, nch, body, (h, factors(0)))

    def zero_chunk(c, carry):                                # rows [len, span): padding of a padded batch
        m = jnp.broadcast_to((rows < span - c * CHUNK)[:, None], (CHUNK, bv))
        pltriton.store(o_ref.at[pl.ds(start + c * CHUNK, CHUNK), hv, vcols], jnp.zeros((CHUNK, bv), o_ref.dtype),
                       mask=m)
        return carry

    jax.lax.fori_loop(nch, (span + CHUNK - 1) // CHUNK, zero_chunk, 0)
    pool_out_ref[slot, hv, vcols, :] = h.T               # same buffer as pool_ref (aliased): in place


# ----------------------------------------------------------------------------------------------------------------
# Wrappers.


def _check_dims(dk, dv, hk, hv):
    for name, d in (("dk", dk), ("dv", dv)):
        if d < 16 or d & (d - 1):
            raise ValueError(f"GDN Pallas kernels need {name} a power of two >= 16, got {d}")
    if hv % hk:
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({hk})")


def _chunk_tiles(chunks, hv, dtype):
    """The [chunks, Hv, 64, 64] T or P output: fp32 (the Triton scan) or bf16 (the Mosaic GPU scan)."""
    return jax.ShapeDtypeStruct((chunks, hv, CHUNK, CHUNK), dtype)


def wy_solve(k, a, b, A_log, dt_bias, row0, nvalid, *, prec, inv_prec, num_warps=1, per_value_head=False,
             dtype=jnp.float32, interpret=False):
    """T = (I + A)^-1 [chunks, Hv, 64, 64] in `dtype` for every flat chunk by `_solve_kernel` (grid (chunk, key head),
    the key head's value heads in a loop, or per_value_head: grid (chunk, value head), K K^T computed per value
    head). prec: raw K K^T of fp32 inputs; inv_prec: the merge products. Unused chunk ids stay unwritten."""
    hk, hv, f32 = k.shape[1], a.shape[1], jnp.float32
    return pl.pallas_call(
        functools.partial(_solve_kernel, ratio=hv // hk, prec=prec, interpret=interpret, inv_prec=inv_prec,
                          per_value_head=per_value_head),
        out_shape=_chunk_tiles(row0.shape[0], hv, dtype),
        grid=(row0.shape[0], hv if per_value_head else hk),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="gdn_solve",
    )(row0, nvalid, k, a, b, A_log.astype(f32), dt_bias.astype(f32))


def wy_prep(q, k, a, b, A_log, dt_bias, row0, nvalid, *, prec, num_warps=4, with_t=False, t_prec="tf32",
            dtype=jnp.float32, interpret=False):
    """P [chunks, Hv, 64, 64] in `dtype` and f [chunks, Hv, 5, 64] fp32 for every flat chunk (module docstring), one
    program per (chunk, key head); with_t: one program per (chunk, value head) that also writes T (by recursive
    doubling, its products in t_prec), returned first: (T, P, f). Unused chunk ids stay unwritten."""
    hk, hv = k.shape[1], a.shape[1]
    mc, f32 = row0.shape[0], jnp.float32
    return pl.pallas_call(
        functools.partial(_prep_kernel, ratio=hv // hk, prec=prec, interpret=interpret, per_value_head=with_t,
                          t_prec=t_prec),
        out_shape=((_chunk_tiles(mc, hv, dtype),) if with_t else ()) + (_chunk_tiles(mc, hv, dtype),)
                  + (jax.ShapeDtypeStruct((mc, hv, 5, CHUNK), f32),),
        grid=(mc, hv if with_t else hk),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="gdn_wy_prep_tpf" if with_t else "gdn_wy_prep_pf",
    )(row0, nvalid, q, k, a, b, A_log.astype(f32), dt_bias.astype(f32))


def wy_scan(q, k, t, v, p, f, pool, starts, lens, spans, slots, use_state, chunk_off, *, config: PrefillConfig,
            precs, interpret=False):
    """The Triton scan given fp32 T, P and f (wy_solve / wy_prep); precs = (Z and Y, P Vnew, the state update,
    T (beta V - ..)). Returns (o [total, Hv, dv] in q.dtype, pool)."""
    total, hk, dk = k.shape
    hv, dv = v.shape[1], v.shape[-1]
    n = starts.shape[0]
    bv = min(config.bv, dv)
    if dv % bv or bv < 16:
        raise ValueError(f"V-block {bv} must divide dv={dv} and be >= 16")
    return pl.pallas_call(
        functools.partial(_scan_kernel, ratio=hv // hk, bv=bv, precs=tuple(precs), interpret=interpret),
        out_shape=(jax.ShapeDtypeStruct((total, hv, dv), q.dtype), jax.ShapeDtypeStruct(pool.shape, pool.dtype)),
        grid=(n, hv, dv // bv),
        input_output_aliases={12: 1},
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps,
                                                num_stages=config.num_stages or pick_stages(n * hv * (dv // bv))),
        interpret=interpret, name="gdn_wy_scan",
    )(starts, lens, spans, slots, use_state, chunk_off, q, k, t, v, p, f, pool)


def chunk_map(starts, lens, max_chunks):
    """Flat chunk ids of packed sequences. Returns (chunk_off [N]: each sequence's first flat chunk,
    row0 [max_chunks]: a chunk's first row, nvalid [max_chunks]: its valid rows, 0 for unused ids)."""
    n = starts.shape[0]
    nch = (lens + CHUNK - 1) // CHUNK
    cum = jnp.cumsum(nch)
    chunk_off = (cum - nch).astype(jnp.int32)
    cid = jnp.arange(max_chunks, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(cum, cid, side="right"), n - 1).astype(jnp.int32)
    local = cid - chunk_off[seq]
    row0 = (starts[seq] + local * CHUNK).astype(jnp.int32)
    nvalid = jnp.where(cid < cum[-1], jnp.clip(lens[seq] - local * CHUNK, 0, CHUNK), 0).astype(jnp.int32)
    return chunk_off, row0, nvalid


def gdn_prefill_packed(q, k, v, a, b, A_log, dt_bias, pool, starts, lens, slots, use_state, *, spans=None,
                       max_chunks=None, config: PrefillConfig = DEFAULT_PREFILL, starts_aligned=False,
                       interpret=False):
    """Packed prefill. q,k [total, Hk, dk]; v [total, Hv, dv]; a,b [total, Hv] raw; pool [slots, Hv, dv, dk] fp32.
    Sequence n is rows [starts[n], starts[n] + lens[n]) (disjoint ranges); it starts from pool[slots[n]] (zeros
    where use_state[n] is False) and its final state is written back there. Output rows [starts + lens,
    starts + spans) are zeroed (spans default to lens); rows outside every sequence are left unwritten.
    max_chunks: static bound on sum(ceil(lens / 64)) (default ceil(total / 64) + N).
    starts_aligned: the caller promises every start is a multiple of 8 (the Mosaic GPU scan needs it: its TMA copies
    into swizzled tiles take row offsets in whole 8-row tiles; without it the Triton scan runs).
    Returns (o [total, Hv, dv] in v.dtype, pool)."""
    total, hk, dk = k.shape
    hv, dv = v.shape[-2:]
    _check_dims(dk, dv, hk, hv)
    if pool.dtype != jnp.float32:
        raise ValueError(f"the GDN state pool must be float32, got {pool.dtype}")
    config = DEFAULT_PREFILL if config is None else config
    if not isinstance(config, PrefillConfig):
        raise TypeError(f"config must be a gdn.PrefillConfig, got {type(config).__name__}")
    i32 = lambda x: jnp.asarray(x).astype(jnp.int32)
    starts, lens, slots, use_state = i32(starts), i32(lens), i32(slots), i32(use_state)
    spans = lens if spans is None else i32(spans)
    max_chunks = max_chunks or (-(-total // CHUNK) + starts.shape[0])
    config = resolve_prep(config, max_chunks, hv, v.dtype)
    mgpu = config.mgpu and gdn_mgpu.applies(total, dk, dv, starts_aligned, v.dtype)
    h_prec, o_prec, s_prec, prep_prec, solve_prec = _precisions(v.dtype)
    chunk_off, row0, nvalid = chunk_map(starts, lens, max_chunks)
    tiles = dict(dtype=jnp.bfloat16 if mgpu else jnp.float32, interpret=interpret)
    if config.prep_mode == "fused":
        t, p, f = wy_prep(q, k, a, b, A_log, dt_bias, row0, nvalid, prec=prep_prec, num_warps=config.prep_warps,
                          with_t=True, t_prec=solve_prec, **tiles)
    else:
        t = wy_solve(k, a, b, A_log, dt_bias, row0, nvalid, prec=prep_prec, inv_prec=solve_prec,
                     num_warps=config.solve_warps, per_value_head=config.solve_grid == "value", **tiles)
        p, f = wy_prep(q, k, a, b, A_log, dt_bias, row0, nvalid, prec=prep_prec, num_warps=config.pf_warps, **tiles)
    if mgpu:
        return gdn_mgpu.scan(q, k, v, t, p, f, pool, starts, lens, spans, slots, use_state, chunk_off,
                             bv=config.mgpu_bv, interpret=interpret)
    return wy_scan(q, k, t, v, p, f, pool, starts, lens, spans, slots, use_state, chunk_off, config=config,
                   precs=(h_prec, o_prec, s_prec, prep_prec), interpret=interpret)


def gdn_prefill(q, k, v, a, b, A_log, dt_bias, pool, slots, lens, use_state, *,
                config: PrefillConfig = DEFAULT_PREFILL, interpret=False):
    """The model's padded-batch contract (gdn_reference.gdn_prefill): row n holds lens[n] real tokens of T."""
    n, t = q.shape[:2]
    flat = lambda x: x.reshape(n * t, *x.shape[2:])
    starts = jnp.arange(n, dtype=jnp.int32) * t
    o, pool = gdn_prefill_packed(flat(q), flat(k), flat(v), flat(a), flat(b), A_log, dt_bias, pool, starts, lens,
                                 slots, use_state, spans=jnp.full((n,), t, jnp.int32),
                                 max_chunks=n * (-(-t // CHUNK)), config=config, starts_aligned=t % 8 == 0,
                                 interpret=interpret)
    return o.reshape(n, t, *o.shape[1:]), pool


# ----------------------------------------------------------------------------------------------------------------
# Decode: one token per row, the state updated in place in the pool.


def _decode_kernel(slot_ref, q_ref, k_ref, v_ref, a_ref, b_ref, alog_ref, dtb_ref, pool_ref, o_ref, pool_out_ref,
                   *, ratio, bv, cols):
    """Grid (V-block, value head, row): the first grid axis is CUDA's x, scheduled fastest, so neighbouring programs
    walk one head's contiguous state. q/k/v/a/b are [N, columns] refs: head h of q starts at column cols[0] + h * dk
    (k, v, a, b likewise at cols[1..4]), so they may all be views of one packed array."""
    vb, hv, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kh = hv // ratio
    slot = slot_ref[n]
    dk = pool_ref.shape[-1]
    q0, k0, v0, a0, b0 = cols
    vcols = pl.ds(vb * bv, bv)

    @pl.when(slot != 0)
    def _():
        q = _l2norm(q_ref[n, pl.ds(q0 + kh * dk, dk)].astype(jnp.float32)) * (dk ** -0.5)
        k = _l2norm(k_ref[n, pl.ds(k0 + kh * dk, dk)].astype(jnp.float32))
        qk = jnp.sum(q * k)
        g, beta = _gates(a_ref[n, a0 + hv], b_ref[n, b0 + hv], alog_ref[hv], dtb_ref[hv])
        alpha = jnp.exp(g)
        s = pool_ref[slot, hv, vcols, :]                          # [BV, dk] fp32, contiguous dk
        v = v_ref[n, pl.ds(v0 + hv * pool_ref.shape[2] + vb * bv, bv)].astype(jnp.float32)
        r_k = jnp.sum(s * k[None, :], axis=1)
        r_q = jnp.sum(s * q[None, :], axis=1)
        u = beta * (v - alpha * r_k)
        o = alpha * r_q + qk * u
        pool_out_ref[slot, hv, vcols, :] = alpha * s + u[:, None] * k[None, :]     # aliased: in place
        o_ref[n, hv, vcols] = o.astype(o_ref.dtype)

    @pl.when(slot == 0)                       # a padding row on the null slot: no state read or written
    def _():
        o_ref[n, hv, vcols] = jnp.zeros((bv,), o_ref.dtype)


def _decode_call(q, k, v, a, b, A_log, dt_bias, pool, slots, cols, hk, config, interpret):
    """The decode kernel on [N, columns] operands (see _decode_kernel's cols); returns (o [N, Hv, dv], pool)."""
    config = DEFAULT_DECODE if config is None else config
    n = q.shape[0]
    hv, dv, dk = pool.shape[1:]
    _check_dims(dk, dv, hk, hv)
    if pool.dtype != jnp.float32:
        raise ValueError(f"the GDN state pool must be float32, got {pool.dtype}")
    bv = min(config.bv, dv)
    if dv % bv or bv & (bv - 1):
        raise ValueError(f"decode V-block {bv} must be a power of two dividing dv={dv}")
    o, pool = pl.pallas_call(
        functools.partial(_decode_kernel, ratio=hv // hk, bv=bv, cols=cols),
        out_shape=(jax.ShapeDtypeStruct((n, hv, dv), v.dtype), jax.ShapeDtypeStruct(pool.shape, pool.dtype)),
        grid=(dv // bv, hv, n),
        input_output_aliases={8: 1},
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret, name="gdn_decode",
    )(jnp.asarray(slots).astype(jnp.int32), q, k, v, a, b, A_log.astype(jnp.float32), dt_bias.astype(jnp.float32),
      pool)
    return o, pool


def gdn_decode(q, k, v, a, b, A_log, dt_bias, pool, slots, *, config: DecodeConfig = DEFAULT_DECODE,
               interpret=False):
    """One token per row (q,k [N,Hk,dk], v [N,Hv,dv], a,b [N,Hv]); padded rows must use the null slot 0, whose
    rows read and write no state and give zeros."""
    n, hk, dk = k.shape
    if v.shape[1:] != pool.shape[1:3] or dk != pool.shape[3]:
        raise ValueError(f"v {v.shape} and k {k.shape} do not match the state pool {pool.shape}")
    flat = lambda x: x.reshape(n, -1)
    return _decode_call(flat(q), flat(k), flat(v), a, b, A_log, dt_bias, pool, slots, (0, 0, 0, 0, 0), hk, config,
                        interpret)


def gdn_decode_packed(qkv, proj, A_log, dt_bias, pool, slots, *, config: DecodeConfig = DEFAULT_DECODE,
                      interpret=False):
    """gdn_decode reading the layer's packed activations in place, so no slice of them is materialised first:
    qkv [N, 2*Hk*dk + Hv*dv] = [q | k | v] (the conv output) and proj [N, P] (the input projection) ending in
    [b | a], Hv columns each. Shapes come from the pool [S, Hv, dv, dk]."""
    hv, dv, dk = pool.shape[1:]
    hk, rem = divmod(qkv.shape[1] - hv * dv, 2 * dk)
    gate_col = proj.shape[1] - 2 * hv
    if rem or hk < 1 or gate_col < 0:
        raise ValueError(f"qkv {qkv.shape} / proj {proj.shape} do not match the state pool {pool.shape}")
    return _decode_call(qkv, qkv, qkv, proj, proj, A_log, dt_bias, pool, slots,
                        (0, hk * dk, 2 * hk * dk, gate_col + hv, gate_col), hk, config, interpret)


# ----------------------------------------------------------------------------------------------------------------
# Several tokens per row from the pool's state (speculative decoding): the verify pass reads the state and writes
# none (its tokens may be rejected); the commit pass advances it by the accepted tokens only.


def _tokens_kernel(slot_ref, len_ref, q_ref, k_ref, v_ref, a_ref, b_ref, alog_ref, dtb_ref, pool_ref, o_ref, *out,
                   ratio, bv, cols, tokens):
    """_decode_kernel over `tokens` tokens per row ([N, T, columns] refs), the state block kept in registers:
    every token's output, and with `out` (the aliased pool) the state after the row's first len tokens."""
    vb, hv, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kh = hv // ratio
    slot, length = slot_ref[n], len_ref[n]
    dk = pool_ref.shape[-1]
    q0, k0, v0, a0, b0 = cols
    g0, b_log = alog_ref[hv], dtb_ref[hv]
    vcols = pl.ds(vb * bv, bv)

    @pl.when(slot != 0)
    def _():
        s = pool_ref[slot, hv, vcols, :]                          # [BV, dk] fp32
        for t in range(tokens):
            q = _l2norm(q_ref[n, t, pl.ds(q0 + kh * dk, dk)].astype(jnp.float32)) * (dk ** -0.5)
            k = _l2norm(k_ref[n, t, pl.ds(k0 + kh * dk, dk)].astype(jnp.float32))
            g, beta = _gates(a_ref[n, t, a0 + hv], b_ref[n, t, b0 + hv], g0, b_log)
            alpha = jnp.exp(g)
            v = v_ref[n, t, pl.ds(v0 + hv * pool_ref.shape[2] + vb * bv, bv)].astype(jnp.float32)
            u = beta * (v - alpha * jnp.sum(s * k[None, :], axis=1))
            o = alpha * jnp.sum(s * q[None, :], axis=1) + jnp.sum(q * k) * u
            o_ref[n, t, hv, vcols] = o.astype(o_ref.dtype)
            s = jnp.where(t < length, alpha * s + u[:, None] * k[None, :], s)
        if out:
            out[0][slot, hv, vcols, :] = s                         # aliased: in place

    @pl.when(slot == 0)                       # a padding row on the null slot: no state read or written
    def _():
        for t in range(tokens):
            o_ref[n, t, hv, vcols] = jnp.zeros((bv,), o_ref.dtype)


def gdn_decode_tokens_packed(qkv, proj, A_log, dt_bias, pool, slots, lens, *, write: bool,
                             config: DecodeConfig = DEFAULT_DECODE, interpret=False):
    """T tokens per row from pool[slots] on the layer's packed activations (qkv [N, T, 2*Hk*dk + Hv*dv], proj
    [N, T, P] ending in [b | a]; as gdn_decode_packed). Returns (o [N, T, Hv, dv], pool): with write, each row's
    state after its first lens[n] tokens is written back in place; without, the pool is only read (returned as
    given). Padded rows must use the null slot 0 (no state read or written, zeros out)."""
    config = DEFAULT_DECODE if config is None else config
    n, tokens = qkv.shape[:2]
    hv, dv, dk = pool.shape[1:]
    hk, rem = divmod(qkv.shape[2] - hv * dv, 2 * dk)
    gate_col = proj.shape[2] - 2 * hv
    if rem or hk < 1 or gate_col < 0 or proj.shape[:2] != (n, tokens):
        raise ValueError(f"qkv {qkv.shape} / proj {proj.shape} do not match the state pool {pool.shape}")
    _check_dims(dk, dv, hk, hv)
    if pool.dtype != jnp.float32:
        raise ValueError(f"the GDN state pool must be float32, got {pool.dtype}")
    bv = min(config.bv, dv)
    if dv % bv or bv & (bv - 1):
        raise ValueError(f"decode V-block {bv} must be a power of two dividing dv={dv}")
    o_shape = jax.ShapeDtypeStruct((n, tokens, hv, dv), qkv.dtype)
    res = pl.pallas_call(
        functools.partial(_tokens_kernel, ratio=hv // hk, bv=bv, cols=(0, hk * dk, 2 * hk * dk, gate_col + hv,
                                                                       gate_col), tokens=tokens),
        out_shape=(o_shape, jax.ShapeDtypeStruct(pool.shape, pool.dtype)) if write else (o_shape,),
        grid=(dv // bv, hv, n),
        input_output_aliases={9: 1} if write else {},
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret, name="gdn_decode_tokens",
    )(jnp.asarray(slots).astype(jnp.int32), jnp.asarray(lens).astype(jnp.int32), qkv, qkv, qkv, proj, proj,
      A_log.astype(jnp.float32), dt_bias.astype(jnp.float32), pool)
    return (res[0], res[1]) if write else (res[0], pool)

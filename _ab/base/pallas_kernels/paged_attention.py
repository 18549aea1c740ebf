"""Paged GQA attention for decode (one query token per row) as a Pallas-Triton kernel.

Why a kernel: the jnp attention (qwen35_jax/model/attention.py, the reference here) walks the pages in a `fori_loop`
whose trip count is read from the data. XLA:GPU runs such a loop on the host, copying the loop predicate back and
blocking on the stream at every iteration, so each attention layer of a decode step was a host-device round trip
and the engine could never dispatch a step ahead. Here the page loop runs inside the kernel (its bound is the
row's own context length, so the cost still follows real lengths) and the step has no host synchronisation.

Layout as the model's KV pool: k/v pages [Hkv, num_pages, page_size, D]; `pages[n]` lists row n's pages in order.
Grid (row, KV head, split): a program takes the G query heads of one KV head (padded to 16 rows, the smallest
tensor-core tile) and one contiguous, equal share of the row's real pages (its context length, not its page table),
`pages_per_block` pages per loop step, with an online softmax in fp32. Splits (flash-decoding) give small batches
enough programs; their partial results are merged outside the kernel. A block's keys are gathered row by row
from the pool viewed as [Hkv, num_pages * page_size, D] (key j: row pages[j // ps] * ps + j % ps), one 2-D load
feeding the dot with no reshape between, which Triton pipelines into asynchronous copies of K and V (a page-wise
gather, [ppb, ps, D] reshaped, reached a clearly lower fraction of the copy bandwidth). Page 0 is the null page:
padding rows write their K / V there and page tables point unused entries at it.

decode_prologue does in one kernel what the decode step runs between qkv_proj and this kernel: q / k RMSNorm and
RoPE, the new K / V written into their pages, q scaled into the kernel's tiles (in place of six small XLA
kernels); its contract is the model's ops (qwen35_jax.model.forward.rms_norm_1p,
rope, qwen35_jax.model.attention.write_kv and the scaling / padding in paged_decode_attention).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

NEG = -1e30          # finite "minus infinity": exp(NEG - m) underflows to 0 without inf - inf = nan
MIN_ROWS = 16        # tl.dot needs M >= 16


def online_softmax_step(s, v, acc, m, l):
    """One key block of flash attention (this kernel's and the prefill kernel's): masked fp32 scores s [R, K] and
    values v [K, D] folded into the running output acc [R, D], max m [R] and sum l [R]."""
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    return acc * alpha[:, None] + pltriton.dot(p.astype(v.dtype), v), m_new, l * alpha + jnp.sum(p, axis=1)


def merge_splits(acc, m, l):
    """Flash-decoding's merge of key splits (this kernel's and the prefill kernel's), outside the kernel: each
    split's unnormalised acc [S, ..., D], max m and sum l [S, ...] rescaled to the common max -> the fp32 output
    [..., D]; rows with no visible key in any split give zeros."""
    big = jnp.max(m, axis=0)
    w = jnp.exp(m - big[None])
    total = jnp.sum(l * w, axis=0)
    return jnp.sum(acc * w[..., None], axis=0) / jnp.where(total > 0, total, 1.0)[..., None]


@dataclasses.dataclass(frozen=True)
class DecodeAttentionConfig:
    """Tiles of the decode attention kernel (the defaults: the fastest of the H200 sweeps, bench/kernel_sweeps.py)."""
    pages_per_block: int = 2      # pages gathered per loop step (page_size * this keys)
    target_programs: int = 264    # splits are chosen so that rows * kv heads * splits reaches this (2 per H200 SM)
    max_splits: int = 32
    num_warps: int = 4
    num_stages: int = 4           # Triton pipeline depth of the K / V gathers

    @property
    def name(self):
        return f"ppb{self.pages_per_block}_t{self.target_programs}_w{self.num_warps}_s{self.num_stages}"


DEFAULT = DecodeAttentionConfig()


def _kernel(ctx_ref, q_ref, k_ref, v_ref, pages_ref, o_ref, m_ref, l_ref, *, page_size, pages_per_block,
            splits):
    """Refs (BlockSpecs): ctx [N] (whole), q [R, D] (this row and KV head), k/v [num_pages * ps, D] (this KV
    head), pages [P'] (this row); outputs o [R, D], m/l [R] for this (split, row, KV head)."""
    n, s = pl.program_id(0), pl.program_id(2)
    ctx = ctx_ref[n]
    # Splits share the row's real pages, not its page table (sized for max_model_len): a short row in a long
    # table still spreads over every split. share <= pages_per_split, so the page reads stay in the table.
    real = (ctx + page_size - 1) // page_size
    share = (real + splits - 1) // splits
    share = (share + pages_per_block - 1) // pages_per_block * pages_per_block
    first = s * share
    last = jnp.minimum(first + share, real)
    steps = jnp.maximum(last - first + pages_per_block - 1, 0) // pages_per_block
    q = q_ref[...]
    rows, d = q.shape
    keys = pages_per_block * page_size
    key = jnp.arange(keys, dtype=jnp.int32)

    def load(i):
        p0 = first + i * pages_per_block
        # key j of the block: row pages[p0 + j // ps] * ps + j % ps of the flat view
        at = pages_ref[p0 + key // page_size] * page_size + key % page_size
        return k_ref[at], v_ref[at]

    def update(i, k, v, acc, m, l):
        s_ = pltriton.dot(q, k, trans_b=True)                                   # [R, keys] fp32 (scaled q)
        pos = (first + i * pages_per_block) * page_size + key
        s_ = jnp.where((pos < ctx)[None, :], s_, NEG)
        return online_softmax_step(s_, v, acc, m, l)

    init = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), NEG, jnp.float32), jnp.zeros((rows,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(0, steps, lambda i, c: update(i, *load(i), *c), init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def num_splits(rows: int, kv_heads: int, pages_per_seq: int, config: DecodeAttentionConfig) -> int:
    """Splits of each row's pages: enough programs for the GPU, never more than page blocks to split."""
    want = -(-config.target_programs // max(1, rows * kv_heads))
    blocks = -(-pages_per_seq // config.pages_per_block)
    return max(1, min(want, config.max_splits, blocks))


def _check(hq, hkv, d, page_size, config):
    if hq % hkv:
        raise ValueError(f"query heads {hq} must be a multiple of KV heads {hkv}")
    if d & (d - 1) or page_size & (page_size - 1) or config.pages_per_block & (config.pages_per_block - 1):
        raise ValueError(f"head_dim ({d}), page_size ({page_size}) and pages_per_block ({config.pages_per_block}) "
                         "must be powers of two (Triton block shapes)")


def query_rows(hq: int, hkv: int) -> int:
    """Rows of each KV head's query tile: its G = Hq / Hkv query heads, padded to a power of two >= 16."""
    return max(MIN_ROWS, _pow2_at_least(hq // hkv))


def paged_decode_attention(q, k_pages, v_pages, pages, ctx_lens, *, config: DecodeAttentionConfig | None = None,
                           interpret: bool = False):
    """q [N, Hq, D] -> [N, Hq, D]: each row attends to its first ctx_lens[n] cached keys (0: zeros out).
    Query head h reads KV head h // (Hq / Hkv); softmax scale D^-0.5; fp32 scores and softmax."""
    config = DEFAULT if config is None else config
    n, hq, d = q.shape
    hkv, _, page_size, _ = k_pages.shape
    _check(hq, hkv, d, page_size, config)
    g, rows = hq // hkv, query_rows(hq, hkv)
    qg = (q.astype(jnp.float32) * d ** -0.5).astype(q.dtype).reshape(n, hkv, g, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - g), (0, 0)))
    return attend_tiles(qg, hq, k_pages, v_pages, pages, ctx_lens, config=config, interpret=interpret)


def attend_tiles(qg, hq, k_pages, v_pages, pages, ctx_lens, *, config: DecodeAttentionConfig | None = None,
                 interpret: bool = False):
    """paged_decode_attention on queries already in the kernel's tiles: qg [N, Hkv, R, D] holds each KV head's
    G = hq / Hkv query heads (scaled by D^-0.5) in its first rows (R = query_rows; the rest are not read into the
    output) -> [N, hq, D] in qg.dtype."""
    config = DEFAULT if config is None else config
    n, hkv, rows, d = qg.shape
    page_size = k_pages.shape[2]
    _check(hq, hkv, d, page_size, config)
    g = hq // hkv
    splits = num_splits(n, hkv, pages.shape[1], config)
    per_split = -(-pages.shape[1] // splits)
    per_split = -(-per_split // config.pages_per_block) * config.pages_per_block
    pages = jnp.pad(pages.astype(jnp.int32), ((0, 0), (0, splits * per_split - pages.shape[1])))
    k_pages = k_pages.reshape(hkv, -1, d)                # [Hkv, num_pages * ps, D]: a free view of the pool
    v_pages = v_pages.reshape(hkv, -1, d)
    kv_spec = pl.BlockSpec((None, *k_pages.shape[1:]), lambda i, h, s: (h, 0, 0))
    f32 = jnp.float32
    o, m, l = pl.pallas_call(
        functools.partial(_kernel, page_size=page_size, pages_per_block=config.pages_per_block, splits=splits),
        grid=(n, hkv, splits),
        in_specs=[pl.BlockSpec((n,), lambda i, h, s: (0,)),
                  pl.BlockSpec((None, None, rows, d), lambda i, h, s: (i, h, 0, 0)),
                  kv_spec, kv_spec,
                  pl.BlockSpec((None, pages.shape[1]), lambda i, h, s: (i, 0))],
        out_specs=[pl.BlockSpec((None, None, None, rows, d), lambda i, h, s: (s, i, h, 0, 0)),
                   pl.BlockSpec((None, None, None, rows), lambda i, h, s: (s, i, h, 0)),
                   pl.BlockSpec((None, None, None, rows), lambda i, h, s: (s, i, h, 0))],
        out_shape=[jax.ShapeDtypeStruct((splits, n, hkv, rows, d), f32),
                   jax.ShapeDtypeStruct((splits, n, hkv, rows), f32),
                   jax.ShapeDtypeStruct((splits, n, hkv, rows), f32)],
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret, name="paged_decode_attention",
    )(ctx_lens.astype(jnp.int32), qg, k_pages, v_pages, pages)
    return merge_splits(o, m, l)[:, :, :g].reshape(n, hq, d).astype(qg.dtype)


# ----------------------------------------------------------------------------------------------------------------
# The decode prologue: q / k norm and RoPE, the new K / V written into their pages, q in the kernel's tiles.


def _prologue_kernel(pos_ref, lens_ref, pages_ref, qkv_ref, qw_ref, kw_ref, inv_ref, k_ref, v_ref, qg_ref,
                     k_out_ref, v_out_ref, *, hq, eps):
    """Grid (row, head): heads [0, Hq) normalise, rotate and scale one query head into its tile row; heads
    [Hq, Hq + Hkv) normalise and rotate one key head, and write it and its value head into the row's page slot
    (the null page 0 for a padding row), and zero that KV head's padding rows of the query tile."""
    n, h = pl.program_id(0), pl.program_id(1)
    hkv, _, page_size, d = k_ref.shape
    rows, half = qg_ref.shape[2], inv_ref.shape[0]
    rd, g = 2 * half, hq // hkv
    # column segments of a head: the two rotary halves, then [rd, D) as power-of-two pieces (Triton block shapes)
    segments, at = [(0, half), (half, half)], rd
    for bit in reversed(range((d - rd).bit_length())):
        if (d - rd) >> bit & 1:
            segments.append((at, 1 << bit))
            at += 1 << bit
    pos = pos_ref[n]
    f32, dtype = jnp.float32, qkv_ref.dtype

    def pieces(ref, at):
        """Columns [at, at + D) of ref's row n (or of ref itself when 1-D), by segment, in fp32."""
        lead = (n,) if ref.ndim == 2 else ()
        return [pltriton.load(ref.at[(*lead, pl.ds(at + c, size))]).astype(f32) for c, size in segments]

    def norm_rope(at, w_ref):
        """model.rms_norm_1p then model.rope, each rounded to the model dtype as there."""
        xs, ws = pieces(qkv_ref, at), pieces(w_ref, 0)
        inv = jax.lax.rsqrt(sum(jnp.sum(x * x) for x in xs) / d + eps)
        xs = [(x * inv * (1.0 + w)).astype(dtype).astype(f32) for x, w in zip(xs, ws)]
        ang = pos.astype(f32) * inv_ref[...]
        cos, sin = jnp.cos(ang), jnp.sin(ang)
        return [(xs[0] * cos - xs[1] * sin).astype(dtype), (xs[1] * cos + xs[0] * sin).astype(dtype),
                *[x.astype(dtype) for x in xs[2:]]]

    def store(ref, lead, xs):
        for (c, size), x in zip(segments, xs):
            pltriton.store(ref.at[(*lead, pl.ds(c, size))], x.astype(ref.dtype))

    @pl.when(h < hq)
    def _():
        scaled = [(x.astype(f32) * d ** -0.5).astype(dtype) for x in norm_rope(h * 2 * d, qw_ref)]
        store(qg_ref, (n, h // g, h % g), scaled)

    @pl.when(h >= hq)
    def _():
        j = h - hq
        k = norm_rope(hq * 2 * d + j * d, kw_ref)
        num = pages_ref.shape[1]
        real = (lens_ref[n] > 0) & (pos < num * page_size)
        page = jnp.where(real, pages_ref[n, jnp.clip(pos // page_size, 0, num - 1)], 0)
        off = jnp.where(real, pos % page_size, 0)
        store(k_out_ref, (j, page, off), k)
        v = pltriton.load(qkv_ref.at[n, pl.ds(hq * 2 * d + hkv * d + j * d, d)])
        pltriton.store(v_out_ref.at[j, page, off, pl.ds(0, d)], v.astype(v_out_ref.dtype))
        if rows > g:
            pad = jnp.arange(rows, dtype=jnp.int32) >= g
            pltriton.store(qg_ref.at[n, j, pl.ds(0, rows), pl.ds(0, d)], jnp.zeros((rows, d), qg_ref.dtype),
                           mask=pad[:, None])


def decode_prologue(qkv, q_norm, k_norm, k_pages, v_pages, pages, positions, lens, *, q_heads: int,
                    rotary_dim: int, theta: float, eps: float, interpret: bool = False):
    """One kernel for what the decode step does between qkv_proj and attention (the model's reference ops:
    q / k RMSNorm, RoPE on the first rotary_dim dims, attention.write_kv, paged_decode_attention's scaling and
    padding; each rounded to the model dtype where those round). qkv [N, Hq*2D + 2*Hkv*D]: per query head q then
    its gate, then k, then v; positions / lens [N] (lens 0: a padding row, its K / V go to the null page).
    Returns (qg [N, Hkv, R, D] for attend_tiles, k_pages, v_pages), the pages updated in place."""
    n, width = qkv.shape
    hkv, _, page_size, d = k_pages.shape
    if width != q_heads * 2 * d + 2 * hkv * d or q_heads % hkv or rotary_dim % 2 or not 0 < rotary_dim <= d:
        raise ValueError(f"qkv {qkv.shape} does not hold {q_heads} query heads (with gates) and {hkv} K / V heads "
                         f"of {d}, or rotary_dim {rotary_dim} is not an even width within them")
    half = rotary_dim // 2
    if d & (d - 1) or half & (half - 1):
        raise ValueError(f"head_dim ({d}) and rotary_dim / 2 ({half}) must be powers of two (Triton block shapes)")
    inv = theta ** (-jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim)      # as model.rope
    i32 = lambda x: jnp.asarray(x).astype(jnp.int32)
    qg, k_pages, v_pages = pl.pallas_call(
        functools.partial(_prologue_kernel, hq=q_heads, eps=eps),
        grid=(n, q_heads + hkv),
        out_shape=(jax.ShapeDtypeStruct((n, hkv, query_rows(q_heads, hkv), d), qkv.dtype),
                   jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)),
        input_output_aliases={7: 1, 8: 2},
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret, name="attention_prologue",
    )(i32(positions), i32(lens), i32(pages), qkv, q_norm, k_norm, inv, k_pages, v_pages)
    return qg, k_pages, v_pages

"""Paged GQA attention for decode (one query token per row) as a Pallas-Triton kernel.

Why a kernel: the jnp attention (qwen35_jax/attention.py, the reference here) walks the pages in a `fori_loop`
whose trip count is read from the data. XLA:GPU runs such a loop on the host, copying the loop predicate back and
blocking on the stream at every iteration, so each attention layer of a decode step was a host-device round trip
and the engine could never dispatch a step ahead. Here the page loop runs inside the kernel (its bound is the
row's own context length, so the cost still follows real lengths) and the step has no host synchronisation.

Layout as the model's KV pool: k/v pages [Hkv, num_pages, page_size, D]; `pages[n]` lists row n's pages in order.
Grid (row, KV head, split): a program takes the G query heads of one KV head (padded to 16 rows, the smallest
tensor-core tile) and one contiguous, equal share of the row's real pages (its context length, not its page table),
`pages_per_block` pages per loop step, with an online softmax in fp32. Splits (flash-decoding) give small batches
enough programs; their partial results are merged outside the kernel. By default (`flat`) a block's keys are
gathered row by row from the pool viewed as [Hkv, num_pages * page_size, D] (key j: row pages[j // ps] * ps +
j % ps), one 2-D load feeding the dot with no reshape between, which Triton pipelines into asynchronous copies
of K and V; the page-wise gather ([ppb, ps, D] reshaped) reached 0.55 of the copy bandwidth on the H200 where
this one reaches 0.85 (bench/RESULTS.md).
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


@dataclasses.dataclass(frozen=True)
class DecodeAttentionConfig:
    pages_per_block: int = 4      # pages gathered per loop step (page_size * this keys)
    target_programs: int = 264    # splits are chosen so that rows * kv heads * splits reaches this (2 per H200 SM)
    max_splits: int = 32
    num_warps: int = 4
    num_stages: int = 2
    flat: bool = False            # gather keys row by row from a [pages * page_size, D] view (one 2-D load, no
                                  # reshape between the load and the dot: the form Triton's pipeliner recognises)

    @property
    def name(self):
        return (f"ppb{self.pages_per_block}_t{self.target_programs}_w{self.num_warps}_s{self.num_stages}"
                + ("_flat" if self.flat else ""))


# Flat gathers, two pages per step, four stages: the H200 sweep at 7030540 (bench/RESULTS.md, "Paged decode
# attention") timed 77.2 vs 130.1 us for the page-wise gathers at batch 64, context 1024 (0.85 of the copy
# bandwidth), 29.5 vs 51.8 us at batch 16; the 9B step at batch 64 went 8.983 -> 8.427 ms untraced.
DEFAULT = DecodeAttentionConfig(pages_per_block=2, num_stages=4, flat=True)


def config_sweep():
    """Variants bench/kernels.py times and triton_compile_check.py compiles (the first is DEFAULT)."""
    c = DecodeAttentionConfig
    # A register double buffer in place of the pipeliner (next block's loads issued before this block's math) timed
    # 108.5 vs 77.2 us at batch 64, context 1k (7030540) and was removed.
    return [DEFAULT, c(pages_per_block=2, num_stages=4), c(), c(pages_per_block=2),
            c(pages_per_block=2, target_programs=528), c(pages_per_block=1, num_stages=4),
            # flat gathers (PyPI Triton 3.9 for sm_90: 86-146 registers against 126-248 page-wise, so 3-5
            # programs per SM instead of 2; K and V both become asynchronous copies)
            c(pages_per_block=1, num_stages=4, flat=True),
            c(pages_per_block=2, num_stages=3, flat=True), c(pages_per_block=4, num_stages=2, flat=True),
            c(pages_per_block=4, num_stages=3, flat=True), c(pages_per_block=4, num_stages=4, flat=True),
            c(pages_per_block=8, num_stages=2, flat=True), c(pages_per_block=4, num_stages=2, flat=True,
                                                             target_programs=132),
            c(pages_per_block=2, num_stages=4, num_warps=8, flat=True)]


def _kernel(ctx_ref, q_ref, k_ref, v_ref, pages_ref, o_ref, m_ref, l_ref, *, page_size, pages_per_block,
            splits, flat):
    """Refs (BlockSpecs): ctx [N] (whole), q [R, D] (this row and KV head), k/v [num_pages, ps, D] (this KV
    head; [num_pages * ps, D] when flat), pages [P'] (this row); outputs o [R, D], m/l [R] for this (split, row,
    KV head)."""
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
        if flat:    # key j of the block: row pages[p0 + j // ps] * ps + j % ps of the flat view
            at = pages_ref[p0 + key // page_size] * page_size + key % page_size
            return k_ref[at], v_ref[at]
        ids = pages_ref[pl.ds(p0, pages_per_block)]
        return k_ref[ids].reshape(keys, d), v_ref[ids].reshape(keys, d)

    def update(i, k, v, acc, m, l):
        s_ = pltriton.dot(q, k, trans_b=True)                                   # [R, keys] fp32 (scaled q)
        pos = (first + i * pages_per_block) * page_size + key
        s_ = jnp.where((pos < ctx)[None, :], s_, NEG)
        m_new = jnp.maximum(m, jnp.max(s_, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s_ - m_new[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + pltriton.dot(p.astype(v.dtype), v)
        return acc, m_new, l

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


def paged_decode_attention(q, k_pages, v_pages, pages, ctx_lens, *, config: DecodeAttentionConfig | None = None,
                           interpret: bool = False):
    """q [N, Hq, D] -> [N, Hq, D]: each row attends to its first ctx_lens[n] cached keys (0: zeros out).
    Query head h reads KV head h // (Hq / Hkv); softmax scale D^-0.5; fp32 scores and softmax."""
    config = DEFAULT if config is None else config
    n, hq, d = q.shape
    hkv, _, page_size, _ = k_pages.shape
    if hq % hkv:
        raise ValueError(f"query heads {hq} must be a multiple of KV heads {hkv}")
    if d & (d - 1) or page_size & (page_size - 1) or config.pages_per_block & (config.pages_per_block - 1):
        raise ValueError(f"head_dim ({d}), page_size ({page_size}) and pages_per_block ({config.pages_per_block}) "
                         "must be powers of two (Triton block shapes)")
    g = hq // hkv
    rows = max(MIN_ROWS, _pow2_at_least(g))
    splits = num_splits(n, hkv, pages.shape[1], config)
    per_split = -(-pages.shape[1] // splits)
    per_split = -(-per_split // config.pages_per_block) * config.pages_per_block
    pages = jnp.pad(pages.astype(jnp.int32), ((0, 0), (0, splits * per_split - pages.shape[1])))
    qg = (q.astype(jnp.float32) * d ** -0.5).astype(q.dtype).reshape(n, hkv, g, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - g), (0, 0)))
    if config.flat:
        k_pages = k_pages.reshape(hkv, -1, d)            # [Hkv, num_pages * ps, D]: a free view of the pool
        v_pages = v_pages.reshape(hkv, -1, d)
        kv_spec = pl.BlockSpec((None, *k_pages.shape[1:]), lambda i, h, s: (h, 0, 0))
    else:
        kv_spec = pl.BlockSpec((None, *k_pages.shape[1:]), lambda i, h, s: (h, 0, 0, 0))
    f32 = jnp.float32
    o, m, l = pl.pallas_call(
        functools.partial(_kernel, page_size=page_size, pages_per_block=config.pages_per_block, splits=splits,
                          flat=config.flat),
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
    # Merge the splits (flash-decoding): rescale each split's sums to the common max.
    big = jnp.max(m, axis=0)
    w = jnp.exp(m - big[None])
    total = jnp.sum(l * w, axis=0)
    acc = jnp.sum(o * w[..., None], axis=0)
    out = acc / jnp.where(total > 0, total, 1.0)[..., None]                   # no visible key: zeros
    return out[:, :, :g].reshape(n, hq, d).astype(q.dtype)

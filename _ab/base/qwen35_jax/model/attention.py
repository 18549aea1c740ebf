"""Paged K/V for the full-attention layers: writing new tokens into pages, and causal GQA attention over them.

Pages are [Hkv, num_pages, page_size, D]; `pages[n]` lists row n's pages in order, 0 (the null page) past its
end. A token at position p lives in page pages[n, p // page_size] at offset p % page_size. Attention walks the
pages in blocks with an online softmax and a loop bound read from the data (the longest context in the batch),
so its cost follows the real context lengths, not max_model_len; training walks every page of the table instead
(a static trip count, which reverse-mode autodiff can go through).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK_TOKENS = 512      # keys per step of the online softmax


def write_kv(k_pages, v_pages, k, v, pages, positions, lens):
    """Scatter k, v [N, T, Hkv, D] of the real tokens into their pages; padding tokens go to the null page."""
    page_size = k_pages.shape[2]
    t = k.shape[1]
    real = (jnp.arange(t)[None, :] < lens[:, None]) & (positions < pages.shape[1] * page_size)
    idx = jnp.clip(positions // page_size, 0, pages.shape[1] - 1)
    page = jnp.where(real, jnp.take_along_axis(pages, idx, axis=1), 0)
    off = jnp.where(real, positions % page_size, 0)
    k_pages = k_pages.at[:, page, off].set(jnp.moveaxis(k, 2, 0).astype(k_pages.dtype))
    v_pages = v_pages.at[:, page, off].set(jnp.moveaxis(v, 2, 0).astype(v_pages.dtype))
    return k_pages, v_pages


def paged_attention(q, k_pages, v_pages, pages, positions, ctx_lens, *, bounded: bool = True):
    """Causal attention of q [N, T, Hq, D] over each row's first ctx_lens[n] cached tokens (the new ones included).
    Query head h reads KV head h // (Hq / Hkv). fp32 scores and softmax; output in q.dtype.
    bounded: stop after the longest context's last block; False walks all of `pages` (differentiable)."""
    n, t, hq, d = q.shape
    hkv, _, page_size, _ = k_pages.shape
    g = hq // hkv
    per_block = max(1, min(pages.shape[1], BLOCK_TOKENS // page_size))
    pad = (-pages.shape[1]) % per_block
    pages = jnp.pad(pages, ((0, 0), (0, pad)))
    block = per_block * page_size
    qg = (q.astype(jnp.float32) * d ** -0.5).reshape(n, t, hkv, g, d).astype(q.dtype)
    num_blocks = (jnp.max(ctx_lens) + block - 1) // block if bounded else pages.shape[1] // per_block

    def body(j, carry):
        m, l, acc = carry                                            # [N,Hkv,G,T], [N,Hkv,G,T], [N,Hkv,G,T,D]
        pg = jax.lax.dynamic_slice_in_dim(pages, j * per_block, per_block, axis=1)
        k = k_pages[:, pg].reshape(hkv, n, block, d)
        v = v_pages[:, pg].reshape(hkv, n, block, d)
        s = jnp.einsum("ntkgd,knld->nkgtl", qg, k, preferred_element_type=jnp.float32)
        key_pos = j * block + jnp.arange(block)
        ok = (key_pos[None, None, :] <= positions[:, :, None]) & (key_pos[None, None, :] < ctx_lens[:, None, None])
        s = jnp.where(ok[:, None, None], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - safe[..., None])
        scale = jnp.exp(jnp.where(jnp.isfinite(m), m - safe, -jnp.inf))
        l = l * scale + p.sum(-1)
        acc = acc * scale[..., None] + jnp.einsum("nkgtl,knld->nkgtd", p.astype(v.dtype), v,
                                                  preferred_element_type=jnp.float32)
        return m_new, l, acc

    init = (jnp.full((n, hkv, g, t), -jnp.inf, jnp.float32), jnp.zeros((n, hkv, g, t), jnp.float32),
            jnp.zeros((n, hkv, g, t, d), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    o = acc / jnp.where(l > 0, l, 1.0)[..., None]                    # rows with no visible key (padding): zeros
    return jnp.moveaxis(o, 3, 1).reshape(n, t, hq, d).astype(q.dtype)


def few_token_attention(decode, q, k_pages, v_pages, pages, start, lens):
    """paged_attention of a few queries per row (q [N, T, Hq, D] at positions start .. start + T - 1, the first
    lens[n] real) through a decode attention kernel (`decode`, with decode_attention's contract): each query is a
    row of its own whose context ends at its position, so only the pages a row's context covers are read. Queries
    past lens see the row's last real position (their output is not used)."""
    n, t, hq, d = q.shape
    seen = start[:, None] + jnp.minimum(jnp.arange(1, t + 1, dtype=jnp.int32)[None, :], lens[:, None])
    o = decode(q.reshape(n * t, hq, d), k_pages, v_pages, jnp.repeat(pages, t, axis=0), seen.reshape(n * t))
    return o.reshape(n, t, hq, d)


def decode_attention(q, k_pages, v_pages, pages, ctx_lens):
    """One query token per row (q [N, Hq, D], at position ctx_lens - 1): the contract of
    pallas_kernels/paged_attention.py, whose reference this is."""
    positions = jnp.maximum(ctx_lens - 1, 0)[:, None]
    return paged_attention(q[:, None], k_pages, v_pages, pages, positions, ctx_lens)[:, 0]

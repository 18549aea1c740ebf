"""Paged K/V for the full-attention layers: writing new tokens into pages, and causal GQA attention over them.

Pages are [Hkv, num_pages, page_size, D]; `pages[n]` lists row n's pages in order, 0 (the null page) past its
end. A token at position p lives in page pages[n, p // page_size] at offset p % page_size.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


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


def paged_attention(q, k_pages, v_pages, pages, positions, ctx_lens):
    """Causal attention of q [N, T, Hq, D] over each row's first ctx_lens[n] cached tokens (the new ones included).
    Query head h reads KV head h // (Hq / Hkv). Softmax in fp32; output in q.dtype."""
    n, t, hq, d = q.shape
    hkv = k_pages.shape[0]
    g = hq // hkv
    k = k_pages[:, pages].reshape(hkv, n, -1, d)            # [Hkv, N, L, D]
    v = v_pages[:, pages].reshape(hkv, n, -1, d)
    qg = q.reshape(n, t, hkv, g, d)
    s = jnp.einsum("ntkgd,knld->nkgtl", qg, k, preferred_element_type=jnp.float32) * (d ** -0.5)
    key_pos = jnp.arange(k.shape[2])
    ok = (key_pos[None, None, :] <= positions[:, :, None]) & (key_pos[None, None, :] < ctx_lens[:, None, None])
    s = jnp.where(ok[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(ok[:, None, None], p, 0.0)                # rows with no visible key (padding) give zeros, not NaN
    o = jnp.einsum("nkgtl,knld->ntkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(n, t, hq, d).astype(q.dtype)

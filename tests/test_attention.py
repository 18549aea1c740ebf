"""Paged attention (blocked online softmax) against a dense causal reference, across several blocks; a few queries
per row as rows of the decode kernel (speculative passes) against the same reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_jax.model import attention


def dense(q, k, v, positions, ctx):
    """q [N,T,Hq,D], k/v [N,L,Hkv,D] contiguous; plain softmax."""
    n, t, hq, d = q.shape
    g = hq // k.shape[2]
    k = jnp.repeat(k, g, axis=2)
    v = jnp.repeat(v, g, axis=2)
    s = jnp.einsum("nthd,nlhd->nhtl", q, k) / np.sqrt(d)
    pos = jnp.arange(k.shape[1])
    ok = (pos[None, None] <= positions[:, :, None]) & (pos[None, None] < ctx[:, None, None])
    s = jnp.where(ok[:, None], s, -jnp.inf)
    p = jnp.where(ok[:, None], jax.nn.softmax(s, -1), 0.0)
    return jnp.einsum("nhtl,nlhd->nthd", p, v)


@pytest.mark.parametrize("g", [1, 3])
def test_blocked_paged_attention_matches_dense(monkeypatch, g):
    monkeypatch.setattr(attention, "BLOCK_TOKENS", 16)
    key = jax.random.key(g)
    n, t, hkv, d, ps, pages_per_seq = 3, 5, 2, 8, 4, 12
    hq = hkv * g
    ctx_max = ps * pages_per_seq                                  # 48 tokens: 3 blocks of 16
    starts = jnp.array([40, 17, 0])
    lens = jnp.array([5, 3, 0])                                   # the last row is padding (ctx 0)
    positions = starts[:, None] + jnp.arange(t)[None]
    ctx = starts + lens
    k_all = jax.random.normal(key, (n, ctx_max, hkv, d))
    v_all = jax.random.normal(jax.random.fold_in(key, 1), (n, ctx_max, hkv, d))
    q = jax.random.normal(jax.random.fold_in(key, 2), (n, t, hq, d))
    # scatter each row's context into shuffled pages (page 0 stays null)
    perm = np.random.default_rng(0).permutation(np.arange(1, 1 + n * pages_per_seq)).reshape(n, pages_per_seq)
    k_pages = jnp.zeros((hkv, 1 + n * pages_per_seq, ps, d))
    v_pages = jnp.zeros_like(k_pages)
    for r in range(n):
        kk = k_all[r].reshape(pages_per_seq, ps, hkv, d).transpose(2, 0, 1, 3)
        k_pages = k_pages.at[:, perm[r]].set(kk)
        v_pages = v_pages.at[:, perm[r]].set(v_all[r].reshape(pages_per_seq, ps, hkv, d).transpose(2, 0, 1, 3))
    got = attention.paged_attention(q, k_pages, v_pages, jnp.asarray(perm), positions, ctx)
    want = dense(q, k_all, v_all, positions, ctx)
    real = (jnp.arange(t)[None] < lens[:, None])[..., None, None]
    np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), atol=1e-5)
    assert np.all(np.asarray(got[2]) == 0)                        # padded row: zeros, no NaN
    few = attention.few_token_attention(attention.decode_attention, q, k_pages, v_pages, jnp.asarray(perm), starts,
                                        lens)
    np.testing.assert_allclose(np.where(real, few, 0), np.where(real, want, 0), atol=1e-5)
    assert np.isfinite(np.asarray(few)).all()

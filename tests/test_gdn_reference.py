"""The pure-jnp GDN and conv references agree with each other (chunked = token scan, decode steps = prefill)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import conv1d_reference as conv
from pallas_kernels import gdn_reference as gdn


def inputs(key, n, t, hk, hv, dk, dv, slots=8):
    ks = jax.random.split(key, 7)
    q = jax.random.normal(ks[0], (n, t, hk, dk))
    k = jax.random.normal(ks[1], (n, t, hk, dk))
    v = jax.random.normal(ks[2], (n, t, hv, dv))
    a = jax.random.normal(ks[3], (n, t, hv))
    b = jax.random.normal(ks[4], (n, t, hv))
    A_log = jnp.log(jax.random.uniform(ks[5], (hv,), minval=0.5, maxval=8.0))
    dt_bias = 0.5 * jax.random.normal(ks[6], (hv,))
    pool = 0.1 * jax.random.normal(jax.random.fold_in(key, 9), (slots, hv, dv, dk))
    return q, k, v, a, b, A_log, dt_bias, pool


@pytest.mark.parametrize("t,ratio", [(1, 1), (63, 2), (64, 3), (130, 2)])
def test_chunked_equals_token_scan(t, ratio):
    q, k, v, a, b, A_log, dt_bias, pool = inputs(jax.random.key(t), 3, t, 2, 2 * ratio, 16, 8)
    slots = jnp.array([3, 1, 5])
    lens = jnp.array([t, max(t - 5, 0), t // 2])
    use = jnp.array([True, False, True])
    o1, p1 = gdn.gdn_prefill(q, k, v, a, b, A_log, dt_bias, pool, slots, lens, use, method="chunked")
    o2, p2 = gdn.gdn_prefill(q, k, v, a, b, A_log, dt_bias, pool, slots, lens, use, method="scan")
    o3, _ = gdn.gdn_prefill(q, k, v, a, b, A_log, dt_bias, pool.at[1].set(0.0), slots, lens, jnp.ones(3, bool),
                            method="scan")
    np.testing.assert_array_equal(o2[1], o3[1])          # use_state False == starting from a zeroed slot
    real = (jnp.arange(t)[None] < lens[:, None])[..., None, None]
    np.testing.assert_allclose(np.where(real, o1, 0), np.where(real, o2, 0), atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(p1, p2, atol=2e-5, rtol=1e-4)
    untouched = np.setdiff1d(np.arange(8), np.asarray(slots))
    np.testing.assert_array_equal(p1[untouched], pool[untouched])


def test_decode_steps_equal_prefill():
    t = 9
    q, k, v, a, b, A_log, dt_bias, pool = inputs(jax.random.key(0), 2, t, 2, 4, 16, 16)
    slots = jnp.array([2, 6])
    o_ref, p_ref = gdn.gdn_prefill(q, k, v, a, b, A_log, dt_bias, pool, slots, jnp.array([t, t]),
                                   jnp.ones(2, bool), method="scan")
    p = pool
    for i in range(t):
        o, p = gdn.gdn_decode(q[:, i], k[:, i], v[:, i], a[:, i], b[:, i], A_log, dt_bias, p, slots)
        np.testing.assert_allclose(o, o_ref[:, i], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(p, p_ref, atol=1e-5, rtol=1e-5)


def test_conv_prefill_chunks_equal_decode_steps():
    n, t, c = 2, 7, 12
    key = jax.random.key(1)
    x = jax.random.normal(key, (n, t, c))
    w = jax.random.normal(jax.random.fold_in(key, 1), (4, c))
    pool = jax.random.normal(jax.random.fold_in(key, 2), (5, 3, c))
    slots = jnp.array([1, 4])
    use = jnp.ones(2, bool)
    y_all, p_all = conv.conv_prefill(x, w, pool, slots, jnp.array([t, t]), use)
    # the same tokens as a 2-token chunk, a 1-token row and decode steps
    y1, p = conv.conv_prefill(x[:, :2], w, pool, slots, jnp.array([2, 2]), use)
    ys = [y1]
    for i in range(2, t):
        yi, p = conv.conv_decode(x[:, i], w, p, slots)
        ys.append(yi[:, None])
    np.testing.assert_allclose(jnp.concatenate(ys, 1), y_all, atol=1e-5)
    np.testing.assert_allclose(p, p_all, atol=1e-6)
    # a short row (lens 1) keeps part of the old state
    _, p_short = conv.conv_prefill(x, w, pool, slots, jnp.array([1, 0]), use)
    y_fresh, _ = conv.conv_prefill(x, w, pool, slots, jnp.array([t, t]), jnp.zeros(2, bool))
    y_zero, _ = conv.conv_prefill(x, w, jnp.zeros_like(pool), slots, jnp.array([t, t]), use)
    np.testing.assert_array_equal(y_fresh, y_zero)
    np.testing.assert_allclose(p_short[1], jnp.concatenate([pool[1, 1:], x[0, :1]], 0))
    np.testing.assert_allclose(p_short[4], pool[4])

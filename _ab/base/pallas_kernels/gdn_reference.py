"""Pure-jnp references of the gated delta rule: the oracle of the Pallas kernels and the portable model path.

Conventions (shared with the kernels):
- q, k: [N, T, Hk, dk] and v: [N, T, Hv, dv] in the model dtype, raw (l2norm and the dk^-0.5 scale happen here);
  value head hv reads key head hv // (Hv // Hk).
- a, b: [N, T, Hv] raw projections; g = -exp(A_log) * softplus(a + dt_bias) (log decay, fp32), beta = sigmoid(b).
- State: fp32, V-first ("K-last") [.., Hv, dv, dk] so a decode row reads contiguous dk vectors; o = S q.
- Padded layout: row n holds lens[n] real tokens then padding. Padding is made inert (g = 0, beta = 0 leave the
  state unchanged), so the final state is the state after the last real token.
- The pool functions read each row's initial state from `pool[slots[n]]` (or start from zeros where
  use_state[n] is False: a fresh request on a recycled slot) and write the final state back there; slot 0 is the
  null slot that padded rows use.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def gates(a, b, A_log, dt_bias):
    """fp32 log-decay g <= 0 and write strength beta in (0, 1) from the raw projections."""
    g = -jnp.exp(A_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    return g, beta


def l2norm(x, eps=1e-6):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _prepare(q, k, v, hv):
    """fp32, l2-normed q (scaled by dk^-0.5) and k, repeated to the value heads (hv // ratio mapping)."""
    ratio = hv // q.shape[-2]
    q = l2norm(q) * (q.shape[-1] ** -0.5)
    k = l2norm(k)
    if ratio > 1:
        q = jnp.repeat(q, ratio, axis=-2)
        k = jnp.repeat(k, ratio, axis=-2)
    return q, k, v.astype(jnp.float32)


def _mask_padding(g, beta, lens):
    t = g.shape[1]
    valid = (jnp.arange(t)[None, :] < lens[:, None])[..., None]
    return jnp.where(valid, g, 0.0), jnp.where(valid, beta, 0.0)


def recurrent_scan(q, k, v, g, beta, state):
    """Token-by-token scan (the ground truth). q,k,v fp32 prepared [N,T,Hv,d]; g,beta [N,T,Hv]; state [N,Hv,dv,dk]."""

    def step(s, xs):
        qt, kt, vt, gt, bt = xs                                   # [N,Hv,dk] [N,Hv,dk] [N,Hv,dv] [N,Hv] [N,Hv]
        s = s * jnp.exp(gt)[..., None, None]
        kv_mem = jnp.einsum("nhvk,nhk->nhv", s, kt, precision=HIGHEST)
        delta = (vt - kv_mem) * bt[..., None]
        s = s + delta[..., :, None] * kt[..., None, :]
        o = jnp.einsum("nhvk,nhk->nhv", s, qt, precision=HIGHEST)
        return s, o

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    state, o = jax.lax.scan(step, state.astype(jnp.float32), xs)
    return jnp.moveaxis(o, 0, 1), state


def unit_lower_inverse(a):
    """(I + A)^-1 for strictly lower-triangular A [..., C, C] (C a power of two) by the product form
    (I - A)(I + A^2)(I + A^4)...: A is nilpotent (A^C = 0), so log2(C) squarings are exact; plain matmuls, which
    XLA runs far faster than a triangular solve on CPU. Entries stay bounded because keys are l2-normalised."""
    c = a.shape[-1]
    eye = jnp.eye(c, dtype=a.dtype)
    m = -a
    out = eye + m
    for _ in range(max(c.bit_length() - 2, 0)):
        m = jnp.einsum("...ij,...jk->...ik", m, m, precision=HIGHEST)
        out = jnp.einsum("...ij,...jk->...ik", out, eye + m, precision=HIGHEST)
    return out


def chunked(q, k, v, g, beta, state, chunk=64):
    """Chunked WY/UT form (exact up to fp32 rounding). Same arguments and results as `recurrent_scan`."""
    n, t, h, dk = k.shape
    dv = v.shape[-1]
    pad = (-t) % chunk
    if pad:   # zero padding is inert: g = 0 (no decay) and beta = 0 (no write)
        q, k, v, g, beta = (jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) for x in (q, k, v, g, beta))
    nc = (t + pad) // chunk

    def split(x):   # [N, T, H, ...] -> [NC, N, H, C, ...]
        x = x.reshape(n, nc, chunk, h, *x.shape[3:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)

    q, k, v, g, beta = map(split, (q, k, v, g, beta))
    gam = jnp.cumsum(g, axis=-1)                                       # [NC,N,H,C] in-chunk cumulative log decay
    lower = jnp.tril(jnp.ones((chunk, chunk), bool))
    diff = gam[..., :, None] - gam[..., None, :]
    decay = jnp.exp(jnp.where(lower, diff, -jnp.inf))                  # mask before exp
    kk = jnp.einsum("...ik,...jk->...ij", k, k, precision=HIGHEST)
    a_mat = jnp.where(jnp.tril(lower, -1), beta[..., :, None] * kk * decay, 0.0)
    inv = unit_lower_inverse(a_mat)                                    # (I + A)^-1, A strictly lower
    u = jnp.einsum("...ij,...jd->...id", inv, beta[..., None] * v, precision=HIGHEST)             # [NC,N,H,C,dv]
    w = jnp.einsum("...ij,...jd->...id", inv, (beta * jnp.exp(gam))[..., None] * k, precision=HIGHEST)
    qk = jnp.einsum("...ik,...jk->...ij", q, k, precision=HIGHEST) * decay
    eg = jnp.exp(gam)
    eg_last = eg[..., -1]
    k_tail = jnp.exp(gam[..., -1:] - gam)[..., None] * k                # decay from row to chunk end

    def step(s, xs):                                                   # s: [N,H,dv,dk]
        u_c, w_c, q_c, qk_c, eg_c, egl_c, kt_c = xs
        v_new = u_c - jnp.einsum("nhck,nhvk->nhcv", w_c, s, precision=HIGHEST)
        o = (eg_c[..., None] * jnp.einsum("nhck,nhvk->nhcv", q_c, s, precision=HIGHEST)
             + jnp.einsum("nhij,nhjv->nhiv", qk_c, v_new, precision=HIGHEST))
        s = egl_c[..., None, None] * s + jnp.einsum("nhcv,nhck->nhvk", v_new, kt_c, precision=HIGHEST)
        return s, o

    state, o = jax.lax.scan(step, state.astype(jnp.float32), (u, w, q, qk, eg, eg_last, k_tail))
    o = jnp.moveaxis(o, 3, 2).reshape(nc, n, chunk, h, dv)             # [NC,N,C,H,dv]
    o = jnp.moveaxis(o, 0, 1).reshape(n, nc * chunk, h, dv)[:, :t]
    return o, state


def gdn_prefill(q, k, v, a, b, A_log, dt_bias, pool, slots, lens, use_state, *, method="chunked"):
    """Prefill rows of a padded batch from their slots' states; returns (o in v.dtype, updated pool)."""
    hv = v.shape[-2]
    g, beta = _mask_padding(*gates(a, b, A_log, dt_bias), lens)
    qf, kf, vf = _prepare(q, k, v, hv)
    fn = chunked if method == "chunked" else recurrent_scan
    init = jnp.where(use_state[:, None, None, None], pool[slots], 0.0)
    o, final = fn(qf, kf, vf, g, beta, init)
    return o.astype(v.dtype), pool.at[slots].set(final)


def gdn_decode(q, k, v, a, b, A_log, dt_bias, pool, slots):
    """One token per row (q,k [N,Hk,dk], v [N,Hv,dv], a,b [N,Hv]) in the fused single-pass form. Rows on the null
    slot 0 (padding) leave its state as it is and give zeros (the decode kernel reads and writes none of it)."""
    hv = v.shape[-2]
    g, beta = gates(a, b, A_log, dt_bias)
    qf, kf, vf = _prepare(q, k, v, hv)
    old = pool[slots]                                                   # [N,Hv,dv,dk]
    alpha = jnp.exp(g)[..., None]
    r_k = jnp.einsum("nhvk,nhk->nhv", old, kf, precision=HIGHEST)
    r_q = jnp.einsum("nhvk,nhk->nhv", old, qf, precision=HIGHEST)
    u = beta[..., None] * (vf - alpha * r_k)
    o = alpha * r_q + jnp.sum(qf * kf, axis=-1, keepdims=True) * u
    s = alpha[..., None] * old + u[..., :, None] * kf[..., None, :]
    live = (slots != 0)[:, None, None]
    return (jnp.where(live, o, 0).astype(v.dtype),
            pool.at[slots].set(jnp.where(live[..., None], s, old)))


def gdn_decode_tokens(q, k, v, a, b, A_log, dt_bias, pool, slots, lens, *, write: bool):
    """T tokens per row continuing the state in pool[slots] (speculative decoding: a verify pass, write False, and
    the commit of its accepted tokens, write True): q,k [N,T,Hk,dk], v [N,T,Hv,dv], a,b [N,T,Hv]. Returns o
    [N,T,Hv,dv] for every token and the pool, holding each row's state after its first lens[n] tokens where write
    (the tokens after them are inert), unchanged otherwise. Rows on the null slot 0 (padding) give zeros and leave
    its state as it is."""
    hv = v.shape[-2]
    g, beta = _mask_padding(*gates(a, b, A_log, dt_bias), lens)
    qf, kf, vf = _prepare(q, k, v, hv)
    o, final = recurrent_scan(qf, kf, vf, g, beta, pool[slots])
    live = slots != 0
    o = jnp.where(live[:, None, None, None], o, 0)
    final = jnp.where(live[:, None, None, None], final, pool[slots])
    return o.astype(v.dtype), pool.at[slots].set(final) if write else pool


def _unpack(qkv, proj, hv, dv, dk):
    """[.., 2*Hk*dk + Hv*dv] = [q | k | v] and proj [.., P] ending in [b | a] -> q, k [.., Hk, dk], v [.., Hv, dv],
    a, b [.., Hv]."""
    lead = qkv.shape[:-1]
    kl = (qkv.shape[-1] - hv * dv) // 2
    gate_col = proj.shape[-1] - 2 * hv
    q, k, v = qkv[..., :kl], qkv[..., kl:2 * kl], qkv[..., 2 * kl:]
    b, a = proj[..., gate_col:gate_col + hv], proj[..., gate_col + hv:gate_col + 2 * hv]
    return q.reshape(*lead, -1, dk), k.reshape(*lead, -1, dk), v.reshape(*lead, hv, dv), a, b


def gdn_decode_tokens_packed(qkv, proj, A_log, dt_bias, pool, slots, lens, *, write: bool):
    """gdn_decode_tokens on packed activations (qkv [N, T, 2*Hk*dk + Hv*dv], proj [N, T, P]; as
    gdn_decode_packed)."""
    q, k, v, a, b = _unpack(qkv, proj, *pool.shape[1:])
    return gdn_decode_tokens(q, k, v, a, b, A_log, dt_bias, pool, slots, lens, write=write)


def gdn_decode_packed(qkv, proj, A_log, dt_bias, pool, slots):
    """gdn_decode on packed activations (the kernels' contract, pallas_kernels.gdn.gdn_decode_packed): qkv
    [N, 2*Hk*dk + Hv*dv] = [q | k | v]; proj ends in [b | a], Hv columns each."""
    q, k, v, a, b = _unpack(qkv, proj, *pool.shape[1:])
    return gdn_decode(q, k, v, a, b, A_log, dt_bias, pool, slots)

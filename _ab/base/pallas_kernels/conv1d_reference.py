"""Pure-jnp reference of the causal depthwise conv1d + SiLU of the Gated DeltaNet (width K, usually 4).

Layouts (shared with the kernels): weight [K, C] (w[K-1] multiplies the current token, PyTorch cross-correlation
order); conv state pool [slots, K-1, C] holding each slot's last K-1 *pre-conv* inputs, oldest first; padded
batch x [N, T, C] with lens[n] real tokens per row. fp32 accumulation, output in x.dtype.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def conv_prefill(x, w, pool, slots, lens, use_state, *, split=None):
    """Conv of each row continuing from its slot's state (zeros where use_state is False: a fresh request);
    the last K-1 real inputs become the new state. The channels are x's first C = w.shape[1] columns
    (x [N, T, >= C]). split: channel offsets (as jnp.split takes them): y comes back as the tuple of its parts
    (the model's q, k and v, which the kernel writes as arrays of their own)."""
    if x.shape[-1] < w.shape[1]:
        raise ValueError(f"conv input has {x.shape[-1]} columns, fewer than the weight's {w.shape[1]} channels")
    x = x[..., :w.shape[1]]
    km1 = w.shape[0] - 1
    t = x.shape[1]
    init = jnp.where(use_state[:, None, None], pool[slots].astype(x.dtype), 0)
    ext = jnp.concatenate([init, x], axis=1)                                   # [N, K-1+T, C]
    extf = ext.astype(jnp.float32)
    wf = w.astype(jnp.float32)
    y = sum(extf[:, j:j + t] * wf[j] for j in range(km1 + 1))
    y = jax.nn.silu(y).astype(x.dtype)
    take = lambda e, n: jax.lax.dynamic_slice_in_dim(e, n, km1, axis=0)        # inputs lens-K+1 .. lens
    new_state = jax.vmap(take)(ext, lens)
    pool = pool.at[slots].set(new_state.astype(pool.dtype))
    return (y if split is None else tuple(jnp.split(y, split, axis=-1))), pool


def conv_decode(x, w, pool, slots):
    """One token per row: the channels are x's first C = w.shape[1] columns (x [N, >= C])."""
    n = x.shape[0]
    y, pool = conv_prefill(x[:, None], w, pool, slots, jnp.ones(n, jnp.int32), jnp.ones(n, bool))
    return y[:, 0], pool

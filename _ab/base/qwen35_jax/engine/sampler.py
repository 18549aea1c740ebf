"""Batched on-device sampling: penalties, temperature, min_p / top_k / top_p, seeded inverse-CDF draws, logprobs.

Every row carries its own parameters. Randomness is keyed on (request seed, request step) only, so a seeded
request samples the same tokens whatever else is in the batch and whichever slot it occupies; unseeded requests
get a random seed at admission. Penalties use per-slot device arrays: counts of generated tokens (presence and
frequency penalties, OpenAI semantics) and a mask of prompt tokens (repetition penalty, HF semantics, over
prompt and output). A token bitmask per row (structured outputs: engine.structured) removes the tokens a grammar
forbids before anything else. Logprobs are those of the raw model distribution (as vLLM returns by default).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

MAX_LOGPROBS = 20
CANDIDATES = 128     # top_k up to this (and top_p under such a top_k) is decided without sorting the vocabulary


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingBatch:
    """Per-row parameters ([B] each)."""
    temperature: Any
    top_k: Any          # 0 = off
    top_p: Any          # 1 = off
    min_p: Any          # 0 = off
    presence: Any
    frequency: Any
    repetition: Any     # 1 = off
    seed: Any           # uint32
    step: Any           # tokens this request has generated before this one (keys the randomness)
    logprobs: Any       # bool: return the top-MAX_LOGPROBS alternatives


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplerState:
    """Device arrays indexed by GDN slot (slot 0 is the null slot)."""
    last_token: Any     # [S+1] int32: the token each slot's next decode step feeds in
    counts: Any         # [S+1, V] int32: generated-token counts
    prompt_mask: Any    # [S+1, V] bool: tokens present in the prompt
    # speculative decoding only (None without it), kept on the device so that the host can dispatch a step before
    # it has read the one before back:
    drafts: Any = None     # [S+1, k] int32: the drafts the next step verifies
    position: Any = None   # [S+1] int32: tokens in the slot's state (the next step's first position)
    sampled: Any = None    # [S+1] int32: tokens the slot's request has sampled


def init_sampler_state(num_slots: int, vocab: int, sharding, dp: int = 1, drafts: int = 0) -> SamplerState:
    """Zeros, made on the devices (works for meshes spanning several processes). With dp replicas the slot axis
    holds dp * (num_slots + 1) rows and `sharding` should split it over dp. drafts: k, the drafts kept per slot."""
    n = dp * (num_slots + 1)
    z = lambda shape, dtype: jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()
    spec = lambda shape: z(shape, jnp.int32) if drafts else None
    return SamplerState(last_token=z((n,), jnp.int32), counts=z((n, vocab), jnp.int32),
                        prompt_mask=z((n, vocab), jnp.bool_), drafts=spec((n, drafts)), position=spec((n,)),
                        sampled=spec((n,)))


def host_batch(rows: list, size: int) -> SamplingBatch:
    """Numpy SamplingBatch for `rows` (objects with .params: SamplingParams, .seed, .num_generated) padded to size."""
    return host_batch_rows(list(rows) + [None] * (size - len(rows)))


def host_batch_rows(rows: list) -> SamplingBatch:
    """Numpy SamplingBatch with one entry per row; None rows (padding) get neutral values."""
    def col(fn, dtype, pad):
        return np.array([pad if r is None else fn(r) for r in rows], dtype)
    return SamplingBatch(
        temperature=col(lambda r: 0.0 if r.params.greedy else r.params.temperature, np.float32, 0.0),
        top_k=col(lambda r: r.params.top_k, np.int32, 0),
        top_p=col(lambda r: r.params.top_p, np.float32, 1.0),
        min_p=col(lambda r: r.params.min_p, np.float32, 0.0),
        presence=col(lambda r: r.params.presence_penalty, np.float32, 0.0),
        frequency=col(lambda r: r.params.frequency_penalty, np.float32, 0.0),
        repetition=col(lambda r: r.params.repetition_penalty, np.float32, 1.0),
        seed=col(lambda r: r.seed, np.uint32, 0),
        step=col(lambda r: r.num_generated, np.int32, 0),
        logprobs=col(lambda r: r.params.logprobs is not None, np.bool_, False))


def allowed_tokens(bitmask, vocab: int):
    """bitmask int32 [B, ceil(vocab / 32)] (bit j of word w: token 32 w + j may be sampled) -> bool [B, vocab]."""
    bits = jnp.right_shift(bitmask[:, :, None], jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab] == 1


def apply_penalties(logits, p: SamplingBatch, counts, prompt_mask):
    counts = counts.astype(jnp.float32)
    logits = logits - p.presence[:, None] * (counts > 0) - p.frequency[:, None] * counts
    seen = prompt_mask | (counts > 0)
    rep = p.repetition[:, None]
    penalized = jnp.where(logits > 0, logits / rep, logits * rep)
    return jnp.where(seen & (rep != 1.0), penalized, logits)


def top_k_desc(x, k: int, blocks: tuple[int, ...] = (16, 8, 8)):
    """Exact top k of each row of x [B, V]: (values descending, indices). XLA:GPU takes a top k with k > 16 by
    sorting the whole row (about a millisecond for a 9B decode batch on the H200), and its sort costs grow fast
    with the row. Here only maxima are sorted, level by level: every entry of the top k lies in a block whose
    maximum is among the k largest block maxima (otherwise k blocks would each hold a larger entry), so the top k
    of those k blocks is the top k of the row, and the same holds one level up for the block maxima themselves
    (a level with at most k blocks keeps them all). With blocks (16, 8, 8) a row of 248320 sorts 243 maxima, then
    k x 8 maxima twice, then k x 16 entries; (16, 8) sorted 1940 maxima first, the slowest sort of the step."""
    b, v = x.shape
    top = int(np.prod(blocks))                                               # entries under one coarsest maximum
    if v <= 4 * k:
        return jax.lax.top_k(x, k)
    x = jnp.pad(x, ((0, 0), (0, -(-v // top) * top - v)), constant_values=-jnp.inf)
    maxima = [x]                                                             # the entries, then each level's maxima
    for blk in blocks:
        maxima.append(maxima[-1].reshape(b, -1, blk).max(-1))
    # top k of the coarsest maxima, then descend: at each level the candidates are the chosen blocks' children
    _, idx = jax.lax.top_k(maxima[-1], min(k, maxima[-1].shape[1]))         # [B, <= k] indices into level L
    for level in range(len(blocks) - 1, -1, -1):
        blk = blocks[level]
        child = (idx[:, :, None] * blk + jnp.arange(blk)).reshape(b, -1)    # indices into level `level`
        vals, pos = jax.lax.top_k(jnp.take_along_axis(maxima[level], child, axis=-1), min(k, child.shape[1]))
        idx = jnp.take_along_axis(child, pos, axis=-1)
    return vals, idx


def needs_full_vocab(p: SamplingBatch) -> bool:
    """Host check: does some sampled row filter beyond what the top-CANDIDATES tokens decide (top_k above
    CANDIDATES, or top_p without a top_k that bounds the nucleus)? Then the step must sort the whole vocabulary."""
    sampled = np.asarray(p.temperature) > 0
    top_k, top_p = np.asarray(p.top_k), np.asarray(p.top_p)
    bounded = (top_k >= 1) & (top_k <= CANDIDATES)
    return bool(np.any(sampled & ((top_k > CANDIDATES) | ((top_p < 1) & ~bounded))))


def needs_extras(p: SamplingBatch) -> bool:
    """Host check: does some row ask for logprobs or a penalty? Batches that do not (most) run the lean sampler,
    which skips the penalty pass over the [B, V] logits and the log-softmax, rank and top-N passes (as vLLM skips
    them when no request of the batch needs them)."""
    return bool(np.any(np.asarray(p.logprobs)) or np.any(np.asarray(p.presence) != 0)
                or np.any(np.asarray(p.frequency) != 0) or np.any(np.asarray(p.repetition) != 1))


SAMPLER_MODES = ("greedy", "lean", "top", "full")
EXTRAS_MODES = ("top", "full")       # the modes that apply penalties and return logprobs


def sampler_mode(p: SamplingBatch) -> str:
    """Which decode sampler a batch needs: "full" (sorts the vocabulary: `needs_full_vocab`), "top" (the top
    CANDIDATES tokens decide the filters, with penalties and logprobs), "lean" (the same without them:
    `needs_extras` is False) or "greedy" (every row greedy and no extras: one argmax, as vLLM's all-greedy path,
    which saves the lean sampler's thresholds and draw)."""
    if needs_full_vocab(p):
        return "full"
    if needs_extras(p):
        return "top"
    return "greedy" if bool(np.all(np.asarray(p.temperature) <= 0)) else "lean"


def _cut(x, p: SamplingBatch, full_vocab: bool = True):
    """Per-row threshold [B, 1] on temperature-scaled logits x [B, V]: the entries at or above it survive min_p,
    top_k and top_p. The thresholds are found on the descending values: the whole row sorted (full_vocab), or
    only its top CANDIDATES, which decide them whenever top_k is in [1, CANDIDATES] (or top_p is off):
    `needs_full_vocab` tells the host which executable a batch needs. The top_p mass is normalised over every
    surviving entry of the row, so both give the same thresholds."""
    m = x.max(-1, keepdims=True)
    desc = -jnp.sort(-x, axis=-1) if full_vocab else top_k_desc(x, min(CANDIDATES, x.shape[-1]))[0]
    min_p_cut = m + jnp.log(p.min_p)[:, None]                             # probs >= min_p * max prob
    kth = jnp.take_along_axis(desc, jnp.clip(p.top_k - 1, 0, desc.shape[-1] - 1)[:, None], axis=-1)
    cut = jnp.maximum(min_p_cut, jnp.where(p.top_k[:, None] > 0, kth, -jnp.inf))
    z = jnp.sum(jnp.where(x >= cut, jnp.exp(x - m), 0.0), axis=-1, keepdims=True)
    probs = jnp.where(desc >= cut, jnp.exp(desc - m), 0.0) / z
    before = jnp.cumsum(probs, axis=-1) - probs                          # mass strictly above each entry
    nucleus = jnp.min(jnp.where((desc >= cut) & (before < p.top_p[:, None]), desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(p.top_p[:, None] < 1.0, jnp.maximum(cut, nucleus), cut), m


def _filter(x, p: SamplingBatch, full_vocab: bool = True):
    """min_p, top_k, top_p on x [B, V]: removed entries become -inf (see `_cut`)."""
    return jnp.where(x < _cut(x, p, full_vocab)[0], -jnp.inf, x)


def _first(hit, fallback):
    """Index of the first True of each row of hit [B, n], or fallback [B] where a row has none."""
    return jnp.where(hit.any(-1), jnp.argmax(hit, axis=-1), fallback)


def _last_positive(w):
    n = w.shape[-1]
    return n - 1 - jnp.argmax(w[:, ::-1] > 0, axis=-1)


def draw(x, cut, m, u, block: int = 128):
    """Exact sample of x [B, V] restricted to x >= cut (weights exp(x - m), m the row max) by inverse CDF in token
    order, in two levels so no [B, V] random numbers are made: u[:, 0] picks a block of `block` tokens by the
    cumulative block sums, u[:, 1] a token inside it by the block's own cumulative weights (P(token) = P(block)
    P(token | block), each level exact). Rows whose cumulative sums round oddly still get a kept token: the choice
    is restricted to positive weights, the last one where no cumulative passes the target."""
    b, v = x.shape
    nb = -(-v // block)
    xb = jnp.pad(x, ((0, 0), (0, nb * block - v)), constant_values=-jnp.inf).reshape(b, nb, block)
    sums = jnp.sum(jnp.where(xb >= cut[:, :, None], jnp.exp(xb - m[:, :, None]), 0.0), axis=-1)     # [B, nb]
    cum = jnp.cumsum(sums, axis=-1)
    bi = _first((cum > u[:, :1] * cum[:, -1:]) & (sums > 0), _last_positive(sums))
    xs = jnp.take_along_axis(xb, bi[:, None, None], axis=1)[:, 0]                                   # [B, block]
    w = jnp.where(xs >= cut, jnp.exp(xs - m), 0.0)
    cw = jnp.cumsum(w, axis=-1)
    j = _first((cw > u[:, 1:] * cw[:, -1:]) & (w > 0), _last_positive(w))
    return (bi * block + j).astype(jnp.int32)


def sample(logits, p: SamplingBatch, counts, prompt_mask, bitmask=None, full_vocab: bool = True, extras: bool = True,
           greedy_only: bool = False):
    """logits [B, V] fp32 (padding columns already -inf) -> (tokens [B] int32, logprob info dict). bitmask: the
    tokens each row may sample (`allowed_tokens`; None: all). full_vocab=False
    is exact only for batches where `needs_full_vocab` is False (see `_cut`); extras=False only for batches where
    `needs_extras` is False: no penalties are applied and the logprob fields are zeros; greedy_only=True (implies
    extras=False) only for batches whose rows are all greedy: the argmax alone.

    Branch-free on purpose: XLA:GPU runs a `lax.cond` by copying its predicate to the host and blocking on the
    stream, which would make every decode dispatch wait for the device. So the filters, the draw and the top-N
    logprobs are computed for every row, and rows that asked for none of them ignore the results; the host picks
    the variant a batch needs (`sampler_mode`). Each step reads the [B, V] logits a few times and sorts at most
    [B, CANDIDATES x 16] values (bench/sampler.py)."""
    extras = extras and not greedy_only
    x = logits if bitmask is None else jnp.where(allowed_tokens(bitmask, logits.shape[-1]), logits, -jnp.inf)
    x = apply_penalties(x, p, counts, prompt_mask) if extras else x
    if greedy_only:
        tokens = jnp.argmax(x, axis=-1).astype(jnp.int32)
    else:
        greedy = p.temperature <= 0
        x_t = x / jnp.where(greedy, 1.0, p.temperature)[:, None]
        cut, m = _cut(x_t, p, full_vocab)
        keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(p.seed, p.step)
        u = jax.vmap(lambda k: jax.random.uniform(k, (2,), jnp.float32))(keys)
        tokens = jnp.where(greedy, jnp.argmax(x, axis=-1).astype(jnp.int32), draw(x_t, cut, m, u))
    b, n = logits.shape[0], min(MAX_LOGPROBS, logits.shape[-1])
    if not extras:
        return tokens, {"logprob": jnp.zeros((b,), jnp.float32), "rank": jnp.zeros((b,), jnp.int32),
                        "top_logprobs": jnp.zeros((b, n), jnp.float32), "top_ids": jnp.zeros((b, n), jnp.int32)}
    return tokens, token_logprobs(logits, tokens)


def token_logprobs(logits, tokens) -> dict:
    """Under the raw distribution of logits [B, V] (log-softmax, padding columns -inf): the logprob and rank
    (1 = most likely) of tokens [B], and the top min(MAX_LOGPROBS, V) (logprob, id) pairs, descending. The
    sampler's logprobs and the prompt logprobs (executor.prefill_step) both come from here."""
    n = min(MAX_LOGPROBS, logits.shape[-1])
    m_raw = jnp.max(logits, axis=-1, keepdims=True)
    lse = m_raw + jnp.log(jnp.sum(jnp.exp(logits - m_raw), axis=-1, keepdims=True))
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)
    top_v, top_i = top_k_desc(logits, n)
    return {"logprob": (chosen - lse)[:, 0], "rank": 1 + jnp.sum(logits > chosen, axis=-1).astype(jnp.int32),
            "top_logprobs": top_v - lse, "top_ids": top_i.astype(jnp.int32)}


def accept_drafts(logits, drafts, p: SamplingBatch, counts, prompt_mask, full_vocab: bool = True,
                  extras: bool = True, greedy_only: bool = False):
    """Speculative verification. logits [B, T, V] fp32 at a row's T = k + 1 verify positions (its last token,
    then its drafts), drafts [B, k] int32 (the MTP head's argmax). Returns (tokens [B, T], count [B], logprob
    info [B, T, ...]): the row's new tokens are tokens[:, :count], its accepted drafts then the token drawn where
    the first draft was rejected (or the bonus token after the last).

    Exact: a greedy draft's distribution is a point mass, so accepting draft d with probability p(d) and, where it
    is rejected, drawing from p without d samples p itself. Each position's p is the row's own distribution
    there: the penalties count the drafts accepted before it, and the filters, temperature and draw are
    `sample`'s. Greedy rows accept a draft equal to the argmax. Position j is keyed on (seed, step + j), as
    `sample` keys a row's step, with its own streams for the accept test and the draw, so a seeded request
    repeats run to run. full_vocab, extras and greedy_only as in `sample` (greedy_only: the argmaxes alone)."""
    b, t, v = logits.shape
    n = min(MAX_LOGPROBS, v)
    zeros = lambda *s, dt=jnp.float32: jnp.zeros((b, t, *s), dt)
    no_info = lambda: {"logprob": zeros(), "rank": zeros(dt=jnp.int32), "top_logprobs": zeros(n),
                       "top_ids": zeros(n, dt=jnp.int32)}
    # drafts kept: those before the first rejected one (accept [B, k])
    kept = lambda accept: jnp.where(accept.all(-1), t - 1, jnp.argmin(accept, axis=-1)).astype(jnp.int32)
    if greedy_only:     # drafts equal to the argmax are kept; the argmax after them is the step's last token
        best = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return best, kept(drafts == best[:, :t - 1]) + 1, no_info()
    pos = lambda x: jnp.repeat(x, t, axis=0)                                 # [B] -> [B * T], row-major
    pt = jax.tree.map(pos, p)
    pt = dataclasses.replace(pt, step=pt.step + jnp.tile(jnp.arange(t, dtype=jnp.int32), b))
    if extras:          # the counts at position j include drafts 1..j
        xs, c = [], counts
        for j in range(t):
            xs.append(apply_penalties(logits[:, j], p, c, prompt_mask))
            if j < t - 1:
                c = c.at[jnp.arange(b), drafts[:, j]].add(1)
        x = jnp.stack(xs, 1).reshape(b * t, v)
    else:
        x = logits.reshape(b * t, v)
    nxt = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1).reshape(b * t)    # the draft after j
    best = jnp.argmax(x, axis=-1).astype(jnp.int32)
    x_t = x / jnp.where(pt.temperature <= 0, 1.0, pt.temperature)[:, None]
    cut, m = _cut(x_t, pt, full_vocab)
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(pt.seed, pt.step)
    u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1), (3,), jnp.float32))(keys)
    d_logit = jnp.take_along_axis(x_t, nxt[:, None], axis=-1)
    z = jnp.sum(jnp.where(x_t >= cut, jnp.exp(x_t - m), 0.0), axis=-1, keepdims=True)
    p_draft = jnp.where(d_logit >= cut, jnp.exp(d_logit - m), 0.0)[:, 0] / z[:, 0]
    accept = jnp.where(pt.temperature <= 0, nxt == best, u[:, 2] < p_draft).reshape(b, t)[:, :t - 1]
    without = jnp.where(jnp.arange(v)[None, :] == nxt[:, None], -jnp.inf, x_t)         # p with the draft removed
    last = (jnp.arange(b * t) % t) == t - 1                                  # the bonus position keeps every token
    drawn = draw(jnp.where(last[:, None], x_t, without), cut, m, u[:, :2])
    drawn = jnp.where(pt.temperature <= 0, best, drawn).reshape(b, t)
    n_acc = kept(accept)
    idx = jnp.arange(t)[None, :]
    tokens = jnp.where(idx < n_acc[:, None], jnp.concatenate([drafts, drafts[:, :1]], axis=1),
                       jnp.take_along_axis(drawn, n_acc[:, None], axis=1))
    if not extras:
        info = no_info()
    else:
        info = jax.tree.map(lambda a: a.reshape(b, t, *a.shape[1:]),
                            token_logprobs(logits.reshape(b * t, v), tokens.reshape(b * t)))
    return tokens, n_acc + 1, info

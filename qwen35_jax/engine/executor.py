"""Compiled engine steps: one XLA executable per prefill bucket and four per decode bucket, built ahead of time.

This is the JAX counterpart of CUDA Graph capture per decode batch bucket (the four decode executables are the
sampler's modes, sampler.sampler_mode: "greedy" an argmax, "lean" from the top candidates without penalties or
logprobs, "top" with them, "full" over the sorted vocabulary): at start-up every bucket is lowered and
compiled (`jit(...).lower(...).compile()`, in parallel threads, persistent compilation cache on), the `Compiled`
objects are kept and called directly, and serving never compiles. With a cache directory, the compiled executables
are also serialized there (`ExecutableCache`), so a warm start loads them without tracing or lowering the model
again (the persistent compilation cache keys on the lowered module, so it saves only XLA's compile; tracing and
lowering each bucket would remain, in Python under the GIL). A decode executable runs `decode_steps` model
steps in a loop on the device, feeding each sampled token into the next step; the next input token of every slot
lives on the device, so the host can dispatch step i+1 before it has read step i's tokens.

Structured outputs split the decode step in two: a constrained row's bitmask needs its previous token, which the
host reads back while the device runs the model step ("logits", per decode bucket), and only the sampler ("sample",
per bucket and mode) waits for the bitmask, as vLLM samples outside its CUDA graph. An engine that never constrains
should not pay their compile at start-up: they are compiled in a background thread when the first constrained
request arrives (`prepare_split`); until they are ready, constrained rows run the regular decode executables with
their bitmask, the host reading each step back before the next.

With a decode-prefill budget (EngineArgs.decode_prefill_budget, mixed_prefill), more executables per decode bucket
and sampler mode, one per chunk length up to the budget, run a decode step and a prefill chunk of one row per
replica as one forward ("mixed", `mixed_step`): the chunk then costs its compute only, not another read of the
weights. Their inputs travel as two packed arrays, the decode rows' and the chunk's.

The prefix cache (engine.prefix_cache) adds two copy executables per decode bucket, precompiled with the rest:
"restore" (snapshot entries -> GDN slots, a partial K/V page -> the request's own page, the sampler rows reset with
the prefix's prompt mask) and "save" (slots -> snapshot entries, a partial page -> the snapshot's page). The
snapshot pool is a State of GDN layers only, sharded as the slots.

Prompt logprobs (SamplingParams.prompt_logprobs) need every position's logits, which the prefill buckets do not
compute: a prefill batch holding a row that asks for them runs a variant of its bucket (key ("prompt_logprobs", n,
t), `prefill_step` with targets). These variants are compiled on first use, never in precompile(): start-up time and
the precompiled executables stay as they are, and the first such batch of each shape waits for its compile.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import logging
import os
import pickle
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from qwen35_jax import env
from qwen35_jax.engine.sampler import (
    EXTRAS_MODES,
    accept_drafts,
    MAX_LOGPROBS,
    SAMPLER_MODES,
    SamplerState,
    SamplingBatch,
    host_batch_rows,
    allowed_tokens,
    sample,
    sampler_mode,
    token_logprobs,
)
from qwen35_jax.engine.scheduler import next_bucket
from qwen35_jax.model.backends import KernelConfig
from qwen35_jax.model.config import ModelConfig
from qwen35_jax.model.forward import (Batch, Kernels, commit, decoder, decoder_groups, draft, forward, last_real,
                                      lm_head)
from qwen35_jax.model.sharding import DP, TP, Layout
from qwen35_jax.model.state import State

log = logging.getLogger(__name__)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepOutput:
    """A step's samples. On the device they travel packed (`_pack_out`); `fetch` unpacks them on the host, where
    the logprob fields are None for steps that ran the lean sampler (no row asked for them)."""
    tokens: jax.Array          # [K, B] (decode), [N] (prefill) or [N, 1 + T] (prompt logprobs: `prefill_step`)
    logprob: jax.Array         # log p of each sampled token under the raw model distribution
    rank: jax.Array            # its rank (1 = most likely)
    top_logprobs: jax.Array    # [..., MAX_LOGPROBS]
    top_ids: jax.Array


STOP_IDS = 8     # stop token ids a speculative step checks per row (EOS first); a row with more may overshoot


def _pack_out(out: StepOutput, extras: bool) -> jax.Array:
    """One int32 [..., W] array per step (one device-to-host copy instead of five): the token, then with extras the
    logprob (fp32 bits), rank, MAX_LOGPROBS top logprobs (fp32 bits) and their ids."""
    cols = [out.tokens[..., None]]
    if extras:
        bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.int32)
        cols += [bits(out.logprob)[..., None], out.rank[..., None], bits(out.top_logprobs), out.top_ids]
    return jnp.concatenate(cols, axis=-1)


def _sample_into(sstate: SamplerState, logits, slots, sp: SamplingBatch, write, bitmask, mode: str = "full"):
    """Sample rows (sampler mode `mode`) among the tokens of their bitmask (sampler.allowed_tokens), then record
    the tokens on the device (next input, penalty counts) where `write` is set."""
    if mode not in SAMPLER_MODES:
        raise ValueError(f"sampler mode must be one of {SAMPLER_MODES}, got {mode!r}")
    tokens, lp = sample(logits, sp, sstate.counts[slots], sstate.prompt_mask[slots], bitmask,
                        full_vocab=mode == "full",
                        extras=mode in EXTRAS_MODES, greedy_only=mode == "greedy")
    target = jnp.where(write, slots, 0)                       # rows not written go to the null slot
    sstate = dataclasses.replace(sstate, last_token=sstate.last_token.at[target].set(tokens),
                                 counts=sstate.counts.at[target, tokens].add(jnp.where(write, 1, 0)))
    return sstate, StepOutput(tokens, lp["logprob"], lp["rank"], lp["top_logprobs"], lp["top_ids"])


def _full_logits(logits):
    """This rank's vocab shard -> the whole (padded) vocabulary: every tp rank then samples identically."""
    return jax.lax.all_gather(logits, TP, axis=logits.ndim - 1, tiled=True)


def _gather_rows(out: StepOutput, axis: int) -> StepOutput:
    """Rows of every dp replica, so the host reads one replicated array."""
    return jax.tree.map(lambda x: jax.lax.all_gather(x, DP, axis=axis, tiled=True), out)


def pack_rows(tree) -> tuple[np.ndarray, tuple]:
    """A step's host inputs (numpy arrays with a leading row axis: 32-bit or bool) -> one int32 [rows, width] array
    (one host-to-device transfer per step instead of one per array) and the static layout `unpack_rows` reads."""
    leaves, treedef = jax.tree.flatten(tree)
    rows = leaves[0].shape[0]
    cols = [(x.view(np.int32) if x.dtype.itemsize == 4 else x.astype(np.int32)).reshape(rows, -1)
            for x in map(np.ascontiguousarray, leaves)]
    return np.concatenate(cols, axis=1), (treedef, tuple((x.shape[1:], x.dtype.str) for x in leaves))


def unpack_rows(x, layout):
    """pack_rows' inverse on the device (any row slice of the packed array: a dp shard)."""
    treedef, specs = layout
    leaves, col = [], 0
    for shape, dtype in specs:
        n, dtype = int(np.prod(shape)), np.dtype(dtype)
        v = x[:, col:col + n].reshape(x.shape[0], *shape)
        col += n
        leaves.append(v != 0 if dtype == np.bool_ else v if dtype == np.int32 else
                      jax.lax.bitcast_convert_type(v, dtype))
    return jax.tree.unflatten(treedef, leaves)


def _prompt_rows(sstate: SamplerState, batch: Batch) -> SamplerState:
    """The sampler rows of a prefill chunk's requests: rows starting at 0 reset their penalty counts and prompt
    mask; the chunk's real tokens join the prompt mask."""
    with jax.named_scope("sampling"):
        fresh = jnp.where(batch.start == 0, batch.slots, 0)
        mask = sstate.prompt_mask.at[fresh].set(False)
        t = batch.tokens.shape[1]
        real = jnp.arange(t)[None, :] < batch.lens[:, None]
        mask = mask.at[jnp.where(real, batch.slots[:, None], 0), batch.tokens].set(True)
        return dataclasses.replace(sstate, counts=sstate.counts.at[fresh].set(0), prompt_mask=mask)


def prefill_step(cfg, layout, kernels, spec_tokens, weights, state, sstate: SamplerState, bitmask, batch: Batch,
                 finishing, sp: SamplingBatch, targets=None, next_tokens=None):
    """Per shard: prompt chunks for this replica's rows. Rows starting at 0 reset their penalty rows; rows whose
    prompt completes here sample their first token. Returns the packed [N, W] output (`_pack_out`).

    targets [N, T] (the prompt-logprobs variant): each position's next prompt token. The output is then
    [N, 1 + T, W]: row 0 as above, row 1 + p the logprob, rank and top alternatives of targets[:, p] under the raw
    (full-vocabulary, unpenalized) distribution at position p (`token_logprobs`).

    spec_tokens k > 0 (speculative decoding): the MTP head runs over the chunk too (forward.draft), pairing each
    position with next_tokens [N, T] (the prompt's next token; at a completing row's last position, the token just
    sampled), and a completing row's k drafts are kept for its first speculative step."""
    sstate = _prompt_rows(sstate, batch)
    if targets is None and not spec_tokens:
        logits, state = forward(cfg, layout, kernels, weights, state, batch, all_logits=False)
    else:       # as forward(all_logits=False) for the samples, with the hidden states kept
        x, state = decoder(cfg, layout, kernels, weights, state, batch)
        logits = lm_head(cfg, weights, last_real(x, batch.lens))
        if targets is not None:     # the head at every position
            every = _full_logits(lm_head(cfg, weights, x))
    with jax.named_scope("sampling"):
        sstate, out = _sample_into(sstate, _full_logits(logits), batch.slots, sp, finishing, bitmask)
    if spec_tokens:
        at_end = jnp.arange(batch.tokens.shape[1])[None, :] == (batch.lens - 1)[:, None]
        nxt = jnp.where(at_end & finishing[:, None], out.tokens[:, None], next_tokens)
        drafts, kp, vp = draft(cfg, layout, kernels, weights, x, nxt, state.k_pages[-1], state.v_pages[-1], batch,
                               spec_tokens)
        state = dataclasses.replace(state, k_pages=state.k_pages[:-1] + [kp], v_pages=state.v_pages[:-1] + [vp])
        done = jnp.where(finishing, batch.slots, 0)         # rows whose first speculative step comes next
        sstate = dataclasses.replace(sstate, drafts=sstate.drafts.at[done].set(drafts),
                                     position=sstate.position.at[done].set(batch.start + batch.lens),
                                     sampled=sstate.sampled.at[done].set(1))
    packed = _pack_out(_gather_rows(out, 0), extras=True)
    if targets is None:
        return state, sstate, packed
    with jax.named_scope("prompt_logprobs"):
        n, t, v = every.shape
        lp = token_logprobs(every.reshape(n * t, v), targets.reshape(n * t))
        lp = jax.tree.map(lambda a: a.reshape(n, t, *a.shape[1:]), lp)
        prompt = StepOutput(targets, lp["logprob"], lp["rank"], lp["top_logprobs"], lp["top_ids"])
        prompt = _pack_out(_gather_rows(prompt, 0), extras=True)
    return state, sstate, jnp.concatenate([packed[:, None], prompt], axis=1)


def decode_step(cfg, layout, kernels, steps, mode, weights, state, sstate: SamplerState, bitmask, slots, positions,
                pages, sp: SamplingBatch):
    """Per shard: `steps` decode steps for this replica's rows (padded rows use slot 0), each feeding its sample
    into the next. mode: the sampler's (sampler.sampler_mode; prefill always runs "full"). bitmask: each row's
    allowed tokens (constrained rows run one step per dispatch: their next mask needs the host)."""
    active = slots > 0

    def one(carry, k):
        state, sstate = carry
        tokens = sstate.last_token[slots]
        batch = Batch(tokens=tokens[:, None], start=positions + k, lens=active.astype(jnp.int32), slots=slots,
                      pages=pages)
        logits, state = forward(cfg, layout, kernels, weights, state, batch, all_logits=False)
        with jax.named_scope("sampling"):
            sstate, out = _sample_into(sstate, _full_logits(logits), slots, dataclasses.replace(sp, step=sp.step + k),
                                       active, bitmask, mode)
        return (state, sstate), out

    if steps == 1:      # no loop: a while loop would split XLA's command buffer (CUDA graph) of the step
        (state, sstate), out = one((state, sstate), jnp.int32(0))
        outs = jax.tree.map(lambda x: x[None], out)
    else:
        (state, sstate), outs = jax.lax.scan(one, (state, sstate), jnp.arange(steps, dtype=jnp.int32))
    return state, sstate, _pack_out(_gather_rows(outs, 1), extras=mode in EXTRAS_MODES)


def mixed_step(cfg, layout, kernels, mode, weights, state, sstate: SamplerState, bitmask, slots, positions, pages,
               sp: SamplingBatch, batch: Batch, finishing, psp: SamplingBatch):
    """Per shard: one decode step (decode_step's, steps = 1, sampler mode `mode`, bitmask its rows') and one
    prefill chunk (prefill_step's: `batch`, `finishing`, sampling batch `psp`, every token allowed) in one forward
    (forward.decoder_groups): their projections, MLP and head read every weight once for both, where two
    executables would read them twice. Returns (state, sstate, (the prefill's packed output, the decode's))."""
    active = slots > 0
    dec = Batch(tokens=sstate.last_token[slots][:, None], start=positions, lens=active.astype(jnp.int32),
                slots=slots, pages=pages)
    sstate = _prompt_rows(sstate, batch)
    (xd, xp), state = decoder_groups(cfg, layout, kernels, weights, state, (dec, batch))
    b = slots.shape[0]
    logits = _full_logits(lm_head(cfg, weights, jnp.concatenate([xd[:, 0], last_real(xp, batch.lens)])))
    with jax.named_scope("sampling"):
        sstate, out = _sample_into(sstate, logits[:b], slots, sp, active, bitmask, mode)
        sstate, pout = _sample_into(sstate, logits[b:], batch.slots, psp, finishing, None)
    out = jax.tree.map(lambda x: x[None], out)
    return state, sstate, (_pack_out(_gather_rows(pout, 0), extras=True),
                           _pack_out(_gather_rows(out, 1), extras=mode in EXTRAS_MODES))


def spec_step(cfg, layout, kernels, k, mode, weights, state, sstate: SamplerState, bitmask, slots, pages,
              sp: SamplingBatch, limits):
    """Per shard: one speculative decoding step (docs/speculative.md) for this replica's rows: the main model
    verifies each row's last token and its k drafts, `accept_drafts` keeps an exact prefix and draws one more
    token, the GDN state advances by the tokens kept (forward.commit), and the MTP head drafts the next k.
    Each row's position and sampled count are the device's (SamplerState), so the host can dispatch a step before
    reading the one before it back. limits = (max_tokens [B], min_tokens [B], stop_ids [B, STOP_IDS], -1 padded):
    a row keeps no more tokens than max_tokens leaves and none after its first stop token counted from min_tokens
    on (as the host's stop test), and a row whose last token ended it keeps nothing (it stays a padded row), so a
    finished row's state ends exactly at its last token (its prefix-cache snapshot) even with a step in flight.
    sp.step is replaced by the device's count. The output is decode_step's packed [T = k + 1, B, W], row j holding
    each row's j-th new token, -1 past the last (the host reads a row's count from it). bitmask: unused
    (structured outputs refuse speculative decoding)."""
    max_tokens, min_tokens, stop_ids = limits
    del bitmask
    sampled, positions = sstate.sampled[slots], sstate.position[slots]
    is_stop = lambda t: (t[..., None] == jnp.expand_dims(stop_ids, tuple(range(1, t.ndim)))).any(-1)
    ended = (is_stop(sstate.last_token[slots]) & (sampled > min_tokens)) | (sampled >= max_tokens)
    active = (slots > 0) & ~ended
    slots, positions, pages = (jnp.where(active, slots, 0), jnp.where(active, positions, 0),
                               jnp.where(active[:, None], pages, 0))
    sp = dataclasses.replace(sp, step=sampled)
    drafts = sstate.drafts[slots]
    batch = Batch(tokens=jnp.concatenate([sstate.last_token[slots][:, None], drafts], axis=1), start=positions,
                  lens=jnp.where(active, k + 1, 0), slots=slots, pages=pages)
    x, state, pending = decoder(cfg, layout, kernels, weights, state, batch, verify=True)
    with jax.named_scope("sampling"):
        tokens, count, lp = accept_drafts(_full_logits(lm_head(cfg, weights, x)), drafts, sp, sstate.counts[slots],
                                          sstate.prompt_mask[slots], full_vocab=mode == "full",
                                          extras=mode in EXTRAS_MODES, greedy_only=mode == "greedy")
        idx = jnp.arange(k + 1)[None, :]        # token j of the step is the row's (sampled + j)-th
        stop = is_stop(tokens) & (sampled[:, None] + idx >= min_tokens[:, None]) & (idx < count[:, None])
        count = jnp.where(stop.any(-1), jnp.argmax(stop, axis=-1) + 1, count)
        count = jnp.where(active, jnp.clip(count, 1, jnp.maximum(max_tokens - sampled, 1)), 0)
    state = commit(cfg, kernels, weights, state, pending, slots, count)
    mtp_batch = dataclasses.replace(batch, tokens=tokens, lens=count)
    new_drafts, kp, vp = draft(cfg, layout, kernels, weights, x, tokens, state.k_pages[-1], state.v_pages[-1],
                               mtp_batch, k)
    state = dataclasses.replace(state, k_pages=state.k_pages[:-1] + [kp], v_pages=state.v_pages[:-1] + [vp])
    with jax.named_scope("sampling"):
        kept = jnp.arange(k + 1)[None, :] < count[:, None]
        target = jnp.where(active, slots, 0)
        last = jnp.take_along_axis(tokens, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
        rows = jnp.broadcast_to(target[:, None], tokens.shape)
        sstate = dataclasses.replace(sstate, last_token=sstate.last_token.at[target].set(last),
                                     counts=sstate.counts.at[rows, tokens].add(kept.astype(jnp.int32)),
                                     drafts=sstate.drafts.at[target].set(new_drafts),
                                     position=sstate.position.at[target].set(positions + count),
                                     sampled=sstate.sampled.at[target].set(sampled + count))
    out = StepOutput(jnp.where(kept, tokens, -1), lp["logprob"], lp["rank"], lp["top_logprobs"], lp["top_ids"])
    out = jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), out)            # [T, B, ...] as decode_step's
    return state, sstate, _pack_out(_gather_rows(out, 1), extras=mode in EXTRAS_MODES)


def decode_logits_step(cfg, layout, kernels, weights, state, sstate: SamplerState, slots, positions, pages):
    """Per shard: one decode model step (as decode_step's) up to its logits over the whole padded vocabulary; the
    constrained path, whose sampler (`sample_step`) is dispatched once the host has the bitmask."""
    active = slots > 0
    batch = Batch(tokens=sstate.last_token[slots][:, None], start=positions, lens=active.astype(jnp.int32),
                  slots=slots, pages=pages)
    logits, state = forward(cfg, layout, kernels, weights, state, batch, all_logits=False)
    return state, _full_logits(logits)


def sample_step(mode, sstate: SamplerState, logits, bitmask, slots, sp: SamplingBatch):
    """Per shard: decode_step's sampling of `decode_logits_step`'s logits; the same packed [1, B, W] output."""
    with jax.named_scope("sampling"):
        sstate, out = _sample_into(sstate, logits, slots, sp, slots > 0, bitmask, mode)
    out = jax.tree.map(lambda x: x[None], out)
    return sstate, _pack_out(_gather_rows(out, 1), extras=mode in EXTRAS_MODES)


def restore_step(state: State, sstate: SamplerState, snaps: State, prompt_bits, slots, entries, src_pages,
                 dst_pages):
    """Per shard: requests resuming from the prefix cache. GDN state of snapshot `entries` -> `slots`, K/V page
    src -> dst (a snapshot's partial page into the request's own), and the slots' sampler rows reset: no generated
    tokens, the prompt mask of the cached prefix (prompt_bits, int32 [rows, words]). Padded rows copy null to
    null."""
    conv = [c.at[slots].set(s[entries]) for c, s in zip(state.conv, snaps.conv)]
    rec = [r.at[slots].set(s[entries]) for r, s in zip(state.recurrent, snaps.recurrent)]
    page = lambda p: p.at[:, dst_pages].set(p[:, src_pages])
    state = State(conv=conv, recurrent=rec, k_pages=[page(k) for k in state.k_pages],
                  v_pages=[page(v) for v in state.v_pages])
    vocab = sstate.counts.shape[1]
    sstate = dataclasses.replace(sstate, counts=sstate.counts.at[slots].set(0),
                                 prompt_mask=sstate.prompt_mask.at[slots].set(allowed_tokens(prompt_bits, vocab)))
    return state, sstate


def save_step(state: State, snaps: State, slots, entries, src_pages, dst_pages):
    """Per shard: snapshots of live slots. GDN state of `slots` -> snapshot `entries`, K/V page src -> dst (the
    request's partial page into the snapshot's own)."""
    snaps = State(conv=[s.at[entries].set(c[slots]) for c, s in zip(state.conv, snaps.conv)],
                  recurrent=[s.at[entries].set(r[slots]) for r, s in zip(state.recurrent, snaps.recurrent)],
                  k_pages=[], v_pages=[])
    page = lambda p: p.at[:, dst_pages].set(p[:, src_pages])
    state = dataclasses.replace(state, k_pages=[page(k) for k in state.k_pages],
                                v_pages=[page(v) for v in state.v_pages])
    return state, snaps


def pow2_buckets(lo: int, hi: int) -> list[int]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return out + [hi]


@functools.lru_cache(maxsize=None)
def source_digest() -> str:
    """sha256 of the sources that define the compiled steps (this package and pallas_kernels/): any code change
    gives every cached executable a new key."""
    h = hashlib.sha256()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for pkg in ("qwen35_jax", "pallas_kernels"):
        for dirpath, dirnames, files in sorted(os.walk(os.path.join(root, pkg))):
            dirnames.sort()
            for f in sorted(files):
                if f.endswith(".py"):
                    h.update(f.encode())
                    h.update(open(os.path.join(dirpath, f), "rb").read())
    return h.hexdigest()


_compile_hits = threading.local()      # persistent-cache hits of the compiles made in this thread


def _count_cache_hit(event: str, **kwargs):
    if event == "/jax/compilation_cache/cache_hits":
        _compile_hits.n = getattr(_compile_hits, "n", 0) + 1


jax.monitoring.register_event_listener(_count_cache_hit)


class ExecutableCache:
    """Compiled executables serialized on disk (jax.experimental.serialize_executable), one file per key. The key
    hashes everything that determines an executable: the caller's description of the step (bucket, model config,
    mesh, abstract inputs, kernel configuration), the sources (`source_digest`), jax / jaxlib and the platform's
    versions, the devices and XLA_FLAGS. A file that does not load
    (another jaxlib wrote it, a torn write) is a logged miss, replaced once the bucket is compiled afresh. Only
    executables compiled in this process are stored: one that JAX's persistent cache handed back was itself
    deserialized, and XLA:CPU does not serialize those faithfully (their functions are missing when loaded again)."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(path, exist_ok=True)
        self.hits = self.misses = 0
        self._count = threading.Lock()      # precompile threads load concurrently

    def _tally(self, hit: bool):
        with self._count:
            if hit:
                self.hits += 1
            else:
                self.misses += 1

    @staticmethod
    def key(*parts) -> str:
        import jaxlib
        dev = jax.devices()[0]
        ident = (parts, source_digest(), jax.__version__, jaxlib.__version__, dev.platform, dev.device_kind,
                 dev.client.platform_version, env.read().xla_flags)
        return hashlib.sha256(repr(ident).encode()).hexdigest()

    def load(self, key: str, devices):
        """The executable stored under key, loaded onto `devices` (its mesh's devices, in mesh order), or None."""
        from jax.experimental import serialize_executable
        path = os.path.join(self.path, key + ".exe")
        if not os.path.exists(path):
            self._tally(False)
            return None
        try:
            with open(path, "rb") as f:
                blob, trees = pickle.load(f)
            exe = serialize_executable.deserialize_and_load(blob, *trees, execution_devices=devices)
        except Exception as e:  # noqa: BLE001 (any unreadable entry is a miss; the caller recompiles)
            log.warning("cached executable %s did not load (%r): compiling it again", path, e)
            self._tally(False)
            return None
        self._tally(True)
        return exe

    def store(self, key: str, exe):
        from jax.experimental import serialize_executable
        blob, in_tree, out_tree = serialize_executable.serialize(exe)
        tmp = os.path.join(self.path, f".{key}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            pickle.dump((blob, (in_tree, out_tree)), f)
        os.replace(tmp, os.path.join(self.path, key + ".exe"))      # atomic: readers never see a partial file


class Executor:
    """Holds the device state and the compiled step for every bucket. Buckets count rows per dp replica; the
    arrays of a step hold dp * rows rows, replica d's at [d * rows, (d + 1) * rows)."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh, layout: Layout, weights, state: State, sstate: SamplerState,
                 kernels: Kernels, kernel_config: KernelConfig, weight_specs, state_specs, *, pages_per_seq: int,
                 decode_buckets, prefill_buckets, decode_steps: int = 1, spec_tokens: int = 0, lazy: bool = False,
                 exe_cache: ExecutableCache | None = None, on_dispatch: Callable | None = None,
                 snapshots: State | None = None, mixed: tuple = ()):
        """kernels: the model's operations made from kernel_config (which keys the cached executables);
        lazy: compile a bucket on first use instead of in precompile(); exe_cache: where compiled steps are kept
        across processes (single-process runs only); on_dispatch: called with (kind, key, host inputs) before each
        dispatch (the multi-host leader publishes them); snapshots: the prefix cache's GDN snapshot pool (None:
        no prefix caching), sharded as state's slots; mixed: the prefill shapes (rows per replica, tokens) of the
        mixed steps (`mixed_step`: a decode step and a prefill chunk in one forward, one executable per shape,
        decode bucket and sampler mode; empty: none)."""
        if mixed and (spec_tokens or decode_steps != 1):
            raise ValueError("mixed steps run one plain decode step beside a prefill chunk: not with speculative "
                             "decoding or decode_steps > 1")
        self.cfg, self.mesh, self.weights, self.state, self.sstate = cfg, mesh, weights, state, sstate
        self.snaps = snapshots
        self._packings: dict = {}
        self.kernels, self.kernel_config = kernels, kernel_config
        self.pages_per_seq, self.decode_steps, self.spec_tokens = pages_per_seq, decode_steps, spec_tokens
        self.mixed_shapes = tuple(mixed)
        self.decode_kind = "spec" if spec_tokens else "decode"      # the decode buckets' executables
        self.dp = mesh.shape[DP]
        self.decode_buckets, self.prefill_buckets = list(decode_buckets), list(prefill_buckets)
        self.replicated = NamedSharding(mesh, P())
        self.rows = NamedSharding(mesh, P(DP))
        self.vocab_padded = layout.vocab_padded
        self.mask_width = -(-layout.vocab_padded // 32)     # int32 words of a row's token bitmask
        spec = P(DP) if spec_tokens else None
        sampler_specs = SamplerState(last_token=P(DP), counts=P(DP), prompt_mask=P(DP), drafts=spec, position=spec,
                                     sampled=spec)
        out_specs = P()                                    # the packed StepOutput (_pack_out), replicated
        # Outputs keep the input layouts, so each step's state feeds the next compiled call unchanged.
        shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)
        outs = (shardings(state), shardings(sstate), self.replicated)

        snap_specs = jax.tree.map(lambda x: x.sharding.spec, snapshots) if snapshots is not None else None

        @functools.lru_cache(maxsize=None)
        def step_fn(kind: str, mode: str | None, rows_layout: tuple):
            """The jitted step reading its host inputs from one packed int32 array (pack_rows)."""
            if kind == "restore":
                body = lambda s, ss, sn, x, m: restore_step(s, ss, sn, m, *unpack_rows(x, rows_layout))
                step = jax.shard_map(body, mesh=mesh, check_vma=False,
                                     in_specs=(state_specs, sampler_specs, snap_specs, P(DP), P(DP)),
                                     out_specs=(state_specs, sampler_specs))
                return jax.jit(step, donate_argnums=(0, 1), out_shardings=outs[:2])
            if kind == "save":
                body = lambda s, sn, x: save_step(s, sn, *unpack_rows(x, rows_layout))
                step = jax.shard_map(body, mesh=mesh, check_vma=False,
                                     in_specs=(state_specs, snap_specs, P(DP)), out_specs=(state_specs, snap_specs))
                return jax.jit(step, donate_argnums=(0, 1), out_shardings=(outs[0], shardings(snapshots)))
            if kind == "logits":
                body = lambda w, s, ss, x: decode_logits_step(cfg, layout, kernels, w, s, ss,
                                                              *unpack_rows(x, rows_layout))
                step = jax.shard_map(body, mesh=mesh, check_vma=False,
                                     in_specs=(weight_specs, state_specs, sampler_specs, P(DP)),
                                     out_specs=(state_specs, P(DP)))
                return jax.jit(step, donate_argnums=(1,), out_shardings=(outs[0], self.rows))
            if kind == "sample":
                body = lambda ss, lg, x, m: sample_step(mode, ss, lg, m, *unpack_rows(x, rows_layout))
                step = jax.shard_map(body, mesh=mesh, check_vma=False,
                                     in_specs=(sampler_specs, P(DP), P(DP), P(DP)),
                                     out_specs=(sampler_specs, out_specs))
                return jax.jit(step, donate_argnums=(0,), out_shardings=outs[1:])
            if kind == "mixed":
                dec_layout, pre_layout = rows_layout
                body = lambda w, s, ss, xd, xp, m: mixed_step(cfg, layout, kernels, mode, w, s, ss, m,
                                                              *unpack_rows(xd, dec_layout),
                                                              *unpack_rows(xp, pre_layout))
                step = jax.shard_map(body, mesh=mesh, check_vma=False,
                                     in_specs=(weight_specs, state_specs, sampler_specs, P(DP), P(DP), P(DP)),
                                     out_specs=(state_specs, sampler_specs, (out_specs, out_specs)))
                return jax.jit(step, donate_argnums=(1, 2),
                               out_shardings=(*outs[:2], (self.replicated, self.replicated)))
            if kind == "decode":
                body = lambda w, s, ss, x, m: decode_step(cfg, layout, kernels, decode_steps, mode, w, s, ss, m,
                                                          *unpack_rows(x, rows_layout))
            elif kind == "spec":
                body = lambda w, s, ss, x, m: spec_step(cfg, layout, kernels, spec_tokens, mode, w, s, ss, m,
                                                        *unpack_rows(x, rows_layout))
            else:
                body = lambda w, s, ss, x, m: prefill_step(cfg, layout, kernels, spec_tokens, w, s, ss, m,
                                                           *unpack_rows(x, rows_layout))
            step = jax.shard_map(body, mesh=mesh, check_vma=False,
                                 in_specs=(weight_specs, state_specs, sampler_specs, P(DP), P(DP)),
                                 out_specs=(state_specs, sampler_specs, out_specs))
            return jax.jit(step, donate_argnums=(1, 2), out_shardings=outs)

        self._step_fn = step_fn
        # staged inputs: each step's packed inputs are first copied (a one-op executable) into a device buffer that
        # stays at one address, so the step's command buffers (CUDA graphs) see unchanged input addresses from
        # call to call; XLA re-records the commands whose buffers moved (CommandBufferThunk).
        self.staged = kernel_config.staged_inputs
        self._stagers: dict[tuple, jax.stages.Compiled] = {}
        self._input_bufs: dict[tuple, jax.Array] = {}
        self._all_allowed: dict[int, jax.Array] = {}       # rows -> the all-ones bitmask of unconstrained steps
        self.compiled: dict[tuple, jax.stages.Compiled] = {}
        self.exe_cache = exe_cache if jax.process_count() == 1 else None
        self.lazy = lazy
        self._logged_prompt_logprobs = False
        self._split = self._split_done = None          # prepare_split's thread and its future
        self.multiprocess = jax.process_count() > 1
        self.on_dispatch = on_dispatch

    # -- abstract inputs -----------------------------------------------------------------------------------------
    def _example_inputs(self, key):
        """Zero host inputs of the bucket's shapes (what `pack_rows` lays out for it)."""
        kind, *shape = key
        z = lambda *sh, dtype=np.int32: np.zeros(sh, dtype)
        if kind == "mixed":         # (decode inputs, prefill inputs): two packed arrays of their own row counts
            return (self._example_inputs(("decode", shape[0], shape[1])),
                    self._example_inputs(("prefill", *shape[2:])))
        if kind in ("restore", "save"):
            return tuple(z(self.dp * shape[0]) for _ in range(4))      # slots, entries, src and dst pages
        if kind in ("decode", "spec", "logits", "sample"):
            b = self.dp * shape[0]
            if kind == "sample":
                return (z(b), host_batch_rows([None] * b))
            sp = (host_batch_rows([None] * b),) if kind != "logits" else ()
            if kind == "spec":
                return (z(b), z(b, self.pages_per_seq)) + sp + ((z(b), z(b), z(b, STOP_IDS)),)
            return (z(b), z(b), z(b, self.pages_per_seq)) + sp
        n, t = self.dp * shape[0], shape[1]
        batch = Batch(tokens=z(n, t), start=z(n), lens=z(n), slots=z(n), pages=z(n, self.pages_per_seq))
        targets = (z(n, t),) if kind == "prompt_logprobs" else (None,) if self.spec_tokens else ()
        nxt = (z(n, t),) if self.spec_tokens else ()
        return (batch, z(n, dtype=np.bool_), host_batch_rows([None] * n), *targets, *nxt)

    def _packing(self, key) -> tuple[tuple, tuple]:
        """(packed shape, rows layout) of the bucket's step inputs, memoized on the executor (a class-level
        lru_cache would hold every executor, with its weights, state and executables, for the process's life). A
        mixed step has two packed inputs: a pair of each."""
        if key not in self._packings:
            example = self._example_inputs(key)
            if key[0] == "mixed":
                parts = [pack_rows(x) for x in example]
                self._packings[key] = tuple(p.shape for p, _ in parts), tuple(lay for _, lay in parts)
            else:
                packed, rows_layout = pack_rows(example)
                self._packings[key] = packed.shape, rows_layout
        return self._packings[key]

    def _abstract(self, tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)

    def _lower(self, key):
        shape, rows_layout = self._packing(key)
        fn = self._step_fn(key[0], key[2] if key[0] in ("decode", "spec", "sample", "mixed") else None, rows_layout)
        w, s, ss = self._abstract(self.weights), self._abstract(self.state), self._abstract(self.sstate)
        rows = lambda *sh, dtype=jnp.int32: jax.ShapeDtypeStruct((shape[0], *sh), dtype, sharding=self.rows)
        if key[0] == "mixed":
            arg = lambda sh: jax.ShapeDtypeStruct(sh, jnp.int32, sharding=self.rows)
            return fn.lower(w, s, ss, arg(shape[0]), arg(shape[1]), arg((shape[0][0], self.mask_width)))
        if key[0] == "restore":
            return fn.lower(s, ss, self._abstract(self.snaps), rows(shape[1]), rows(self.mask_width))
        if key[0] == "save":
            return fn.lower(s, self._abstract(self.snaps), rows(shape[1]))
        if key[0] == "logits":
            return fn.lower(w, s, ss, rows(shape[1]))
        if key[0] == "sample":
            return fn.lower(ss, rows(self.vocab_padded, dtype=jnp.float32), rows(shape[1]),
                            rows(self.mask_width))
        return fn.lower(w, s, ss, rows(shape[1]), rows(self.mask_width))

    def keys(self):
        """The precompiled buckets; decode buckets come once per sampler mode (sampler.sampler_mode). The
        prompt-logprobs variants of the prefill buckets and the split decode steps of structured outputs are not
        among them (compiled on first use; `prepare_split`)."""
        copies = [(k, b) for k in ("restore", "save") for b in self.decode_buckets] if self.snaps is not None else []
        mixed = [("mixed", b, mode, *shape) for shape in self.mixed_shapes for mode in SAMPLER_MODES
                 for b in self.decode_buckets]
        return ([(self.decode_kind, b, mode) for mode in SAMPLER_MODES for b in self.decode_buckets]
                + [("prefill", n, t) for n, t in self.prefill_buckets] + copies + mixed)

    def split_keys(self):
        """The split decode steps of constrained batches: the model step per bucket, the sampler per bucket and
        mode."""
        return ([("logits", b) for b in self.decode_buckets]
                + [("sample", b, mode) for mode in SAMPLER_MODES for b in self.decode_buckets])

    def prepare_split(self):
        """Start compiling the split decode steps in a background thread (once; a lazy executor compiles each on
        first use instead). The thread is joined at interpreter exit, before jax's backends go."""
        if self.lazy or self._split is not None:
            return
        def compile_all():
            try:
                for key in sorted(self.split_keys(), key=lambda k: k[0] != "logits"):     # the slow ones first
                    if key not in self.compiled:
                        self.compiled[key] = self._compile(key)
            except BaseException:
                log.exception("compiling the split decode steps failed: constrained rows keep reading each step "
                              "back before the next")
                raise
            log.info("the split decode steps of structured outputs are compiled")
        self._split = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="qwen35-split-compile")
        self._split_done = self._split.submit(compile_all)

    def wait_split(self, timeout: float | None = None):
        """Block until prepare_split's compile has ended (re-raising its error); a no-op when none was started."""
        if self._split_done is not None:
            self._split_done.result(timeout)

    @property
    def split_ready(self) -> bool:
        """Can constrained decode batches run split (its executables compiled, or compiled on use)?"""
        return self.lazy or (self._split_done is not None and self._split_done.done()
                             and self._split_done.exception() is None)

    def precompile(self, threads: int | None = None, progress: bool = True, kinds: tuple | None = None) -> float:
        """Compile every bucket ahead of time (kinds: only those of these kinds, e.g. ("save", "restore") for a
        lazy executor's prefix-cache copies); returns the sweep's wall time in seconds. The slowest compiles are
        started first (prefill buckets by tokens, then the decode modes from the vocabulary sort down to the
        argmax, larger buckets first): queued last, they would make the sweep's tail."""
        cost = lambda k: ((1, k[1] * k[2]) if k[0] == "prefill" else (1, k[3] * k[4] + k[1]) if k[0] == "mixed"
                          else (0, SAMPLER_MODES.index(k[2]), k[1]) if k[0] in ("decode", "spec") else (-1, k[1]))
        keys = sorted((k for k in self.keys() if k not in self.compiled and (kinds is None or k[0] in kinds)),
                      key=cost, reverse=True)
        t0 = time.perf_counter()
        threads = max(1, threads or min(len(keys), os.cpu_count() or 2, 16))
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(keys), desc="precompiling buckets", unit="exe")
        old = threading.stack_size()
        threading.stack_size(64 << 20)      # XLA lowering recurses deeply; 8 MB thread stacks overflow
        try:
            with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as pool:
                futures = {pool.submit(self._compile, k): k for k in keys}
                for fut in concurrent.futures.as_completed(futures):
                    self.compiled[futures[fut]] = fut.result()
                    if bar is not None:
                        bar.update(1)
        finally:
            threading.stack_size(old)
            if bar is not None:
                bar.close()
        dt = time.perf_counter() - t0
        cached = f", {self.exe_cache.hits} loaded from {self.exe_cache.path}" if self.exe_cache else ""
        log.info("precompiled %d executables in %.1fs (%d threads%s)", len(keys), dt, threads, cached)
        return dt

    def _cache_key(self, key) -> str:
        describe = lambda tree: (str(jax.tree.structure(tree)),
                                 [(x.shape, str(x.dtype), str(x.sharding.spec)) for x in jax.tree.leaves(tree)])
        mesh = (self.mesh.axis_names, self.mesh.devices.shape, [d.id for d in self.mesh.devices.flat])
        return ExecutableCache.key(key, repr(self.cfg), mesh, self.pages_per_seq, self.decode_steps,
                                   repr(self.kernel_config), describe(self.weights), describe(self.state),
                                   describe(self.sstate), describe(self.snaps) if self.snaps is not None else None)

    def _compiler_options(self, key) -> dict:
        """KernelConfig.xla_options over the bucket's own. Prefill: its GEMMs from cuBLAS alone, no Triton GEMMs
        (XLA's autotuner sometimes picks a slower Triton GEMM for out_proj / o_proj, and with Triton GEMMs off XLA
        folds the residual adds into cuBLAS's epilogue). A decode bucket whose row-parallel GEMMs the model splits
        over K itself (Kernels.split_k): XLA's own K splits off, so that it splits no other GEMM (in_proj). A mixed
        step: XLA's choice, as decode (its GEMMs have the few rows of a decode batch plus a short chunk; with
        Triton GEMMs off, 32- and 64-token chunks cost the same ~8 ms per step on the H100: docs/long_context.md)."""
        k, own = self.kernels, dict(self.kernel_config.xla_options)
        if key[0] in ("prefill", "prompt_logprobs"):
            return {"xla_gpu_enable_triton_gemm": False, **own}
        if key[0] in ("decode", "logits") and k.split_k > 1 and key[1] >= k.split_k_from:
            return {"xla_gpu_experimental_force_split_k": 1, **own}
        return own

    def _compile(self, key) -> jax.stages.Compiled:
        """The bucket's executable: from the executable cache, else lowered and compiled (and then cached)."""
        ckey = self._cache_key(key) if self.exe_cache is not None else None
        exe = self.exe_cache.load(ckey, list(self.mesh.devices.flat)) if ckey else None
        if exe is None:
            before = getattr(_compile_hits, "n", 0)
            exe = self._lower(key).compile(compiler_options=self._compiler_options(key) or None)
            if ckey and getattr(_compile_hits, "n", 0) == before:     # compiled here, not a persistent-cache hit
                self.exe_cache.store(ckey, exe)
        if self.staged:
            packed = self._packing(key)[0]
            inputs = packed if key[0] == "mixed" else (packed,)
            for shape in (*inputs, (inputs[0][0], self.mask_width)):      # the packed inputs, the bitmask
                if shape not in self._stagers:
                    stage = jax.jit(lambda buf, x: jax.lax.dynamic_update_slice(buf, x, (0, 0)), donate_argnums=0,
                                    out_shardings=self.rows)      # in place: the output keeps the buffer's address
                    spec = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.rows)
                    self._stagers[shape] = stage.lower(spec, spec).compile()
        return exe

    def _exe(self, key):
        exe = self.compiled.get(key)
        if exe is None:
            if key[0] == self.decode_kind and key[1] not in self.decode_buckets:   # a step serving never runs
                raise ValueError(f"decode bucket {key[1]} is not one of this engine's {self.decode_buckets}")
            if key[0] == "prompt_logprobs":
                if not self._logged_prompt_logprobs:
                    log.info("compiling the prompt-logprobs variant of prefill bucket %s on first use (these "
                             "variants are not precompiled: the first batch of each shape waits for its compile)",
                             key[1:])
                    self._logged_prompt_logprobs = True
            elif not self.lazy and key[0] not in ("logits", "sample"):
                raise RuntimeError(f"no compiled executable for bucket {key}; run precompile() first")
            exe = self.compiled[key] = self._compile(key)
        return exe

    # -- dispatch (asynchronous: returns device arrays) -----------------------------------------------------------
    def _put(self, tree):
        """Host inputs -> step inputs. Across processes each process holds the whole (identical) host arrays and
        contributes its devices' rows."""
        if not self.multiprocess:
            return tree
        return jax.tree.map(lambda x: jax.make_array_from_callback(x.shape, self.rows, lambda i: x[i]), tree)

    def run_prefill(self, chunks, shape, prompt_logprobs: bool = False, bitmask: Callable | None = None
                    ) -> tuple[list, jax.Array]:
        """Lay out the scheduler's prompt chunks as one prefill bucket of `shape` = (rows per replica, tokens per
        row) (replica d's rows at [d * rows, (d + 1) * rows)) and dispatch it. Returns the rows ((request,
        completes its prompt, chunk) or None) and the packed output. prompt_logprobs: run the bucket's
        prompt-logprobs variant, every position's target being the prompt token after it (`prefill_step`).
        bitmask: called with the rows that sample (a request, else None), returns their token bitmask or None
        (`structured.Grammars.bitmask`)."""
        rows, arrays = self._prefill_rows(chunks, shape, prompt_logprobs)
        mask = bitmask([x[0] if x and x[1] else None for x in rows]) if bitmask else None
        tokens, start, lens, slots, pages, finishing, sp, targets, following = arrays
        return rows, self.prefill(shape, tokens, start, lens, slots, pages, finishing, sp, targets, mask, following)

    def _prefill_rows(self, chunks, shape, prompt_logprobs: bool = False) -> tuple[list, tuple]:
        """run_prefill's rows and host arrays (tokens, start, lens, slots, pages, finishing, sampling batch,
        targets or None, the MTP head's next tokens or None)."""
        n, t = shape
        total = self.dp * n
        tokens = np.zeros((total, t), np.int32)
        targets = np.zeros((total, t), np.int32) if prompt_logprobs else None
        following = np.zeros((total, t), np.int32) if self.spec_tokens else None     # the MTP head's next tokens
        start, lens, slots = (np.zeros(total, np.int32) for _ in range(3))
        pages = np.zeros((total, self.pages_per_seq), np.int32)
        finishing = np.zeros(total, np.bool_)
        rows: list = [None] * total
        used = [0] * self.dp
        for c in chunks:
            r = c.request
            i = r.replica * n + used[r.replica]
            used[r.replica] += 1
            tokens[i, :c.length] = r.prompt_ids[c.start:c.start + c.length]
            nxt = r.prompt_ids[c.start + 1:c.start + c.length + 1]     # none after the prompt's last token
            for a in (targets, following):
                if a is not None:
                    a[i, :len(nxt)] = nxt
            start[i], lens[i], slots[i] = c.start, c.length, r.slot
            pages[i, :len(r.pages)] = r.pages
            finishing[i] = c.completes_prompt
            rows[i] = (r, bool(finishing[i]), c)
        sp = host_batch_rows([x[0] if x else None for x in rows])
        return rows, (tokens, start, lens, slots, pages, finishing, sp, targets, following)

    def run_decode(self, requests, bitmask: Callable | None = None, stops: Callable | None = None
                   ) -> tuple[list, jax.Array | Callable]:
        """Lay out the decoding requests in the smallest decode bucket that holds each replica's rows and dispatch
        it. Returns the rows (request or None) and the packed output. With bitmask (as in run_prefill: some rows
        are constrained) and the split steps ready (`split_ready`), only the model step is dispatched, and the
        output is a function that dispatches the sampler with bitmask(rows), called once the host has advanced the
        rows' grammars, returning the output; before they are ready, the decode executable runs with bitmask(rows)
        (the caller has read every step in flight back)."""
        b, rows, slots, positions, pages, sp = self._decode_rows(requests)
        if self.spec_tokens:        # positions and budgets are the device's; the host gives each row's limits
            stop_ids = np.full((len(rows), STOP_IDS), -1, np.int32)
            for i, r in enumerate(rows):
                if r is not None and stops is not None:
                    ids = stops(r)[:STOP_IDS]
                    stop_ids[i, :len(ids)] = ids
            limit = lambda f: np.array([0 if r is None else f(r) for r in rows], np.int32)
            limits = (limit(lambda r: r.max_tokens), limit(lambda r: r.params.min_tokens), stop_ids)
            return rows, self.decode(b, slots, None, pages, sp, limits=limits)
        if bitmask is None or not self.split_ready:
            return rows, self.decode(b, slots, positions, pages, sp, bitmask(rows) if bitmask else None)
        if self.decode_steps != 1:
            raise ValueError("constrained decoding runs one step per dispatch (decode_steps=1)")
        logits = self._run(("logits", b), (slots, positions, pages))
        return rows, lambda: self._run(("sample", b, sampler_mode(sp)), (slots, sp), bitmask(rows), logits)

    def _decode_rows(self, requests) -> tuple[int, list, np.ndarray, np.ndarray, np.ndarray, SamplingBatch]:
        """run_decode's bucket, rows and host arrays (slots, positions, pages, sampling batch)."""
        counts = [0] * self.dp
        for r in requests:
            counts[r.replica] += 1
        b = next_bucket(max(counts), self.decode_buckets)
        slots, positions = np.zeros(self.dp * b, np.int32), np.zeros(self.dp * b, np.int32)
        pages = np.zeros((self.dp * b, self.pages_per_seq), np.int32)
        rows: list = [None] * (self.dp * b)
        used = [0] * self.dp
        for r in requests:
            i = r.replica * b + used[r.replica]
            used[r.replica] += 1
            slots[i], positions[i] = r.slot, r.num_computed
            pages[i, :len(r.pages)] = r.pages
            rows[i] = r
        return b, rows, slots, positions, pages, host_batch_rows(rows)

    def run_mixed(self, requests, chunks, shape) -> tuple[tuple[list, jax.Array], tuple[list, jax.Array]]:
        """run_decode's requests (none constrained) and run_prefill's chunks (none sampling under a grammar or
        asking for prompt logprobs) of prefill shape `shape` (one of `mixed_shapes`) as one mixed step. Returns
        ((prefill rows, packed output), (decode rows, packed output)), each as run_prefill's and run_decode's."""
        if shape not in self.mixed_shapes:
            raise ValueError(f"mixed steps have prefill shapes {self.mixed_shapes}, got {shape}")
        b, drows, slots, positions, pages, sp = self._decode_rows(requests)
        prows, (tokens, start, lens, pslots, ppages, finishing, psp, _, _) = self._prefill_rows(chunks, shape)
        pre = (Batch(tokens=tokens, start=start, lens=lens, slots=pslots, pages=ppages), finishing, psp)
        pout, dout = self.mixed(b, shape, (slots, positions, pages, sp), pre)
        return (prows, pout), (drows, dout)

    def mixed(self, bucket, shape, decode_inputs, prefill_inputs) -> tuple[jax.Array, jax.Array]:
        """Run the mixed step of decode bucket `bucket` and prefill shape `shape` on decode_inputs (slots,
        positions, pages, sampling batch; dp * bucket rows) and prefill_inputs (Batch, finishing, sampling batch);
        returns the packed outputs (prefill's, decode's)."""
        if self.on_dispatch is not None:
            self.on_dispatch("mixed", (bucket, *shape), (decode_inputs, prefill_inputs))
        key = ("mixed", bucket, sampler_mode(decode_inputs[3]), *shape)
        return self._run(key, (decode_inputs, prefill_inputs))

    def prefill(self, shape, tokens, start, lens, slots, pages, finishing, sp: SamplingBatch,
                targets=None, bitmask=None, following=None) -> jax.Array:
        """shape = (rows per replica, tokens per row); arrays hold dp * rows rows. targets [rows, tokens]: run the
        prompt-logprobs variant (`prefill_step`). bitmask: int32 [rows, mask_width] of the tokens each row may
        sample (None: any). following [rows, tokens]: with speculative decoding, each position's next prompt token
        (prefill_step's next_tokens). Returns the step's packed output (read it with `fetch`)."""
        if (following is None) != (not self.spec_tokens):
            raise ValueError("following (the next prompt tokens) is needed exactly when decoding speculatively")
        inputs = (Batch(tokens=tokens, start=start, lens=lens, slots=slots, pages=pages), finishing, sp)
        kind = "prefill" if targets is None else "prompt_logprobs"
        if targets is not None or following is not None:
            inputs += (targets,)
        if following is not None:
            inputs += (following,)
        if self.on_dispatch is not None:
            self.on_dispatch(kind, shape, inputs)
        return self._run((kind, *shape), inputs, bitmask)

    def run_copies(self, kind: str, copies: list) -> None:
        """Dispatch the prefix cache's device copies: kind "restore" (snapshot -> slot, before the requests'
        first chunk) or "save" (slot -> snapshot), `copies` as (replica, prefix_cache.Copy); restores carry the
        prefix's token ids, whose prompt mask the sampler rows get."""
        from qwen35_jax.engine.prefix_cache import prefix_bits
        per_replica = [[c for r, c in copies if r == d] for d in range(self.dp)]
        cap = self.decode_buckets[-1]
        for start in range(0, max(map(len, per_replica), default=0), cap):     # at most a bucket's rows a call
            parts = [p[start:start + cap] for p in per_replica]
            b = next_bucket(max(map(len, parts)), self.decode_buckets)
            cols = np.zeros((4, self.dp * b), np.int32)
            bits = np.zeros((self.dp * b, self.mask_width), np.int32) if kind == "restore" else None
            for replica, part in enumerate(parts):
                for j, c in enumerate(part):
                    i = replica * b + j
                    cols[:, i] = c.slot, c.entry, c.src_page, c.dst_page
                    if bits is not None:
                        bits[i] = prefix_bits(c.tokens, self.mask_width)
            self.copy_state(kind, b, *cols, bits)

    def copy_state(self, kind: str, bucket: int, slots, entries, src_pages, dst_pages, prompt_bits=None):
        """Run copy bucket (kind, bucket) on host arrays of dp * bucket rows (`run_copies` lays them out)."""
        inputs = (slots, entries, src_pages, dst_pages)
        if self.on_dispatch is not None:
            self.on_dispatch(kind, (bucket,), inputs + ((prompt_bits,) if kind == "restore" else ()))
        self._run((kind, bucket), inputs, prompt_bits)

    def decode(self, bucket, slots, positions, pages, sp: SamplingBatch, bitmask=None, limits=None) -> jax.Array:
        """bucket = rows per replica; arrays hold dp * bucket rows; bitmask as in `prefill`. With speculative
        decoding: positions None (the device keeps them) and limits, spec_step's. Returns the step's packed output
        (`fetch`)."""
        if (limits is None or positions is not None) != (not self.spec_tokens):
            raise ValueError("speculative decoding takes limits and no positions (the device keeps each row's); "
                             "plain decoding takes positions and no limits")
        inputs = (slots, positions, pages, sp) if limits is None else (slots, pages, sp, limits)
        if self.on_dispatch is not None:
            self.on_dispatch("decode", (bucket,), inputs)
        return self._run((self.decode_kind, bucket, sampler_mode(sp)), inputs, bitmask)

    def _stage(self, name: str, key, host):
        """Host array -> a device input; staged: copied into the device buffer kept for (bucket, input name)."""
        if not self.staged:
            return self._put(host)
        buf = self._input_bufs.get((key, name))
        if buf is None:
            zeros = np.zeros_like(host)
            buf = self._put(zeros) if self.multiprocess else jax.device_put(zeros, self.rows)
        x = self._input_bufs[(key, name)] = self._stagers[host.shape](buf, self._put(host))
        return x

    def _all_allowed_mask(self, rows: int) -> jax.Array:
        """The bitmask input of unconstrained steps (every token allowed), made once per row count."""
        ones = self._all_allowed.get(rows)
        if ones is None:
            host = np.full((rows, self.mask_width), -1, np.int32)
            ones = self._all_allowed[rows] = self._put(host) if self.multiprocess else jax.device_put(host, self.rows)
        return ones

    def _run(self, key, inputs, bitmask=None, logits=None) -> jax.Array:
        exe = self._exe(key)                    # compiles it (and its stager) first when lazy
        parts = inputs if key[0] == "mixed" else (inputs,)        # a mixed step: (decode inputs, prefill inputs)
        wants = self._packing(key)[1] if key[0] == "mixed" else (self._packing(key)[1],)
        packed = []
        for part, want in zip(parts, wants):
            x, rows_layout = pack_rows(part)
            if rows_layout != want:
                raise ValueError(f"inputs for bucket {key} do not match its shapes and dtypes: {rows_layout[1]} != "
                                 f"{want[1]}")
            packed.append(x)
        rows = packed[0].shape[0]
        if bitmask is not None and bitmask.shape != (rows, self.mask_width):
            raise ValueError(f"bitmask for bucket {key} must be [{rows}, {self.mask_width}], got {bitmask.shape}")
        mask = self._all_allowed_mask(rows) if bitmask is None else self._stage("bitmask", key, bitmask)
        staged = [self._stage(name, key, x) for name, x in zip(("inputs", "prefill_inputs"), packed)]
        return self._call(key, exe, staged[0] if key[0] != "mixed" else tuple(staged), mask, logits)

    def call(self, key, packed) -> jax.Array:
        """Run bucket `key` (decode or prefill) on packed inputs (pack_rows: host or device array), every token
        allowed."""
        return self._call(key, self._exe(key), packed, self._all_allowed_mask(packed.shape[0]))

    def _call(self, key, exe, packed, bitmask, logits=None) -> jax.Array:
        """Runs the step; returns its packed output (`fetch` reads it), or a "logits" step's logits."""
        if key[0] == "restore":
            self.state, self.sstate = exe(self.state, self.sstate, self.snaps, packed, bitmask)
            return None
        if key[0] == "save":
            self.state, self.snaps = exe(self.state, self.snaps, packed)
            return None
        if key[0] == "logits":
            self.state, logits = exe(self.weights, self.state, self.sstate, packed)
            return logits
        if key[0] == "sample":
            self.sstate, out = exe(self.sstate, logits, packed, bitmask)
        elif key[0] == "mixed":
            self.state, self.sstate, outs = exe(self.weights, self.state, self.sstate, *packed, bitmask)
            return tuple(o.addressable_data(0) for o in outs)
        else:
            self.state, self.sstate, out = exe(self.weights, self.state, self.sstate, packed, bitmask)
        return out.addressable_data(0)         # replicated: this process's copy is the whole output


def fetch(out: jax.Array) -> StepOutput:
    """A step's packed output (`_pack_out`) -> numpy StepOutput; logprob fields None where the step had none. A
    prompt-logprobs prefill's [N, 1 + T, W] output gives [N, 1 + T] fields: [:, 0] the samples, [:, 1:] the
    prompt positions (tokens: the targets)."""
    a = np.asarray(out)
    if a.shape[-1] == 1:
        return StepOutput(a[..., 0], None, None, None, None)
    m = (a.shape[-1] - 3) // 2                 # MAX_LOGPROBS, or the vocabulary if smaller
    return StepOutput(a[..., 0], a[..., 1].view(np.float32), a[..., 2], a[..., 3:3 + m].view(np.float32),
                      a[..., 3 + m:3 + 2 * m])


__all__ = ["Executor", "ExecutableCache", "StepOutput", "fetch", "pack_rows", "pow2_buckets", "unpack_rows",
           "MAX_LOGPROBS"]

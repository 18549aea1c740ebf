"""Speculative decoding's model passes (issue 38): a verify pass over T tokens per row, then the commit of each
row's accepted prefix, must leave the model exactly where a plain prefill of those tokens would."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import fixture_dir
from qwen35_jax.model import forward as fw
from qwen35_jax.model.backends import KernelConfig, make_kernels
from qwen35_jax.model.config import load_config
from qwen35_jax.model.runner import ModelRunner, make_batch
from qwen35_jax.model.sharding import DP, TP, Layout, make_mesh
from qwen35_jax.model.weights import load_weights


def verify_and_commit(cfg, layout, kernels, weights, state, batch, accepted):
    """Per shard: the verify pass's logits at every position, and the state after committing `accepted` tokens."""
    x, state, pending = fw.decoder(cfg, layout, kernels, weights, state, batch, verify=True)
    return fw.lm_head(cfg, weights, x), fw.commit(cfg, kernels, weights, state, pending, batch.slots, accepted)


@pytest.mark.parametrize("backend,tp", [("reference", 1), ("pallas_interpret", 1), ("reference", 2)])
def test_verify_then_commit_equals_prefill_of_the_accepted_tokens(backend, tp):
    """Rows accept 0, 2 and all 4 of their verify tokens (and a padded row): the verify logits at the accepted
    positions equal a plain chunk's, and after the commit the next decode step's logits equal the plain path's,
    so the GDN recurrent and conv state advanced by exactly the accepted tokens."""
    model = fixture_dir("mm_tied_r2_g2")
    cfg = load_config(model)
    mesh = make_mesh(tp)
    weights = load_weights(model, cfg, mesh, jnp.float32)
    layout = Layout.build(cfg, tp)
    kernels = make_kernels(KernelConfig(backend=backend).resolved())
    rng = np.random.default_rng(3)
    n, prompt, t, pages = 4, 21, 4, 4
    table = np.array([1 + i * pages + np.arange(pages) for i in range(3)] + [np.zeros(pages, int)])
    slots, lens = [1, 2, 3, 0], [prompt] * 3 + [0]
    prompts = rng.integers(0, cfg.vocab_size, (n, prompt))
    draft = rng.integers(0, cfg.vocab_size, (n, t))
    accepted = np.array([1, 3, 4, 0])         # tokens committed: the fed token alone, two drafts, every draft

    def runner():
        r = ModelRunner(cfg, mesh, layout, weights, jnp.float32, kernels, num_slots=3, num_pages=1 + 3 * pages,
                        page_size=8)
        r.run(make_batch(prompts, [0] * n, lens, slots, table))
        return r

    spec = runner()
    body = functools.partial(verify_and_commit, cfg, layout, kernels)
    batch_spec = fw.BATCH_SPEC
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec._w_specs, spec._s_specs, batch_spec, P(DP)),
                               out_specs=(P(DP, None, TP), spec._s_specs), check_vma=False))
    live = [1] * 3 + [0]
    verify_logits, spec.state = fn(spec.weights, spec.state, make_batch(draft, [prompt] * n, [t * x for x in live],
                                                                        slots, table), jnp.asarray(accepted, jnp.int32))
    verify_logits = np.asarray(verify_logits)[..., :cfg.vocab_size]

    plain = runner()
    want = np.asarray(plain.run(make_batch(draft, [prompt] * n, list(accepted), slots, table),
                                all_logits=True))[..., :cfg.vocab_size]
    scale = np.abs(want[:3]).max()
    for row in range(3):
        m = accepted[row]
        err = np.abs(verify_logits[row, :m] - want[row, :m]).max()
        assert err <= 1e-5 * scale, f"row {row}: verify logits off by {err:.2e}"
    # one more token after the committed ones, on both paths: equal only if the states advanced alike
    nxt = rng.integers(0, cfg.vocab_size, (n, 1))
    after = make_batch(nxt, [prompt + m for m in accepted], live, slots, table)
    got = np.asarray(spec.run(after))[..., :cfg.vocab_size]
    ref = np.asarray(plain.run(after))[..., :cfg.vocab_size]
    for row in range(3):
        err = np.abs(got[row] - ref[row]).max()
        assert err <= 1e-5 * scale, f"row {row}: the step after the commit is off by {err:.2e}"


# -- the acceptance sampler ----------------------------------------------------------------------------------------
def batch(b, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=None, step=0, presence=0.0):
    from qwen35_jax.engine.sampler import SamplingBatch
    full = lambda x, dt: jnp.full((b,), x, dt)
    return SamplingBatch(temperature=full(temperature, jnp.float32), top_k=full(top_k, jnp.int32),
                         top_p=full(top_p, jnp.float32), min_p=full(min_p, jnp.float32),
                         presence=full(presence, jnp.float32), frequency=full(0.0, jnp.float32),
                         repetition=full(1.0, jnp.float32),
                         seed=jnp.arange(b, dtype=jnp.uint32) if seed is None else full(seed, jnp.uint32),
                         step=full(step, jnp.int32), logprobs=full(False, jnp.bool_))


@pytest.mark.parametrize("greedy_only", [False, True])
def test_greedy_acceptance_is_the_argmax_chain(greedy_only):
    """Greedy rows keep drafts while each equals the argmax at its position, then take the argmax: in a batch of
    mixed rows and in the all-greedy variant."""
    from qwen35_jax.engine.sampler import accept_drafts
    v, t = 11, 4
    logits = jax.random.normal(jax.random.key(0), (3, t, v))
    best = np.asarray(jnp.argmax(logits, -1))
    drafts = np.array([best[0, :3],                                  # all accepted: bonus = argmax at position 3
                       [best[1, 0], (best[1, 1] + 1) % v, 0],        # second draft rejected
                       [(best[2, 0] + 1) % v, best[2, 1], best[2, 2]]])   # first rejected
    z = jnp.zeros((3, v), jnp.int32)
    tokens, count, _ = accept_drafts(logits, jnp.asarray(drafts, jnp.int32), batch(3, temperature=0.0), z,
                                     z.astype(bool), extras=False, greedy_only=greedy_only)
    tokens, count = np.asarray(tokens), np.asarray(count)
    assert count.tolist() == [4, 2, 1]
    assert tokens[0].tolist() == best[0].tolist()
    assert tokens[1, :2].tolist() == [best[1, 0], best[1, 1]] and tokens[2, 0] == best[2, 0]


@pytest.mark.parametrize("draft,filters", [(0, {}), (3, {}), (5, dict(top_k=3)), (1, dict(top_p=0.7, min_p=0.05))],
                         ids=["likely", "unlikely", "filtered-out", "top-p-min-p"])
def test_first_token_keeps_the_target_distribution(draft, filters):
    """Chi-square: over 40,000 seeds, the first new token of a row (the draft if accepted, else the draw without
    it) follows the row's own filtered, tempered distribution, whatever the draft."""
    from scipy.stats import chisquare

    from qwen35_jax.engine.sampler import accept_drafts, sample
    rows, v = 40_000, 6
    base = jnp.array([2.0, 1.5, 1.0, 0.2, -0.5, -1.0])
    logits = jnp.broadcast_to(base, (rows, 2, v))
    p = batch(rows, temperature=0.8, **filters)
    z = jnp.zeros((rows, v), jnp.int32)
    tokens, _, _ = jax.jit(accept_drafts, static_argnames=("full_vocab", "extras"))(
        logits, jnp.full((rows, 1), draft, jnp.int32), p, z, z.astype(bool), extras=False)
    got = np.bincount(np.asarray(tokens[:, 0]), minlength=v)
    # the target: the plain sampler's distribution of the same row (its exact probabilities, from its support)
    ref, _ = sample(logits[:, 0], p, z, z.astype(bool), extras=False)
    support = np.bincount(np.asarray(ref), minlength=v) > 0
    x = np.asarray(base, np.float64) / 0.8
    probs = np.where(support, np.exp(x - x.max()), 0.0)
    probs /= probs.sum()
    assert not got[~support].any(), f"tokens outside the filtered support: {got}"
    expected = rows * probs[support]
    stat = chisquare(got[support].astype(np.float64), expected)
    assert stat.pvalue > 1e-3, (got, rows * probs)


# -- the whole speculative loop at the model level, on the trained default model and its MTP head ---------------
def _programs(cfg, mesh, layout, kernels, k, w_specs, s_specs):
    """SPMD programs over (weights, state): a greedy prefill that also drafts, a speculative step (verify, accept,
    commit, draft), and a plain greedy decode step."""
    from qwen35_jax.engine.sampler import accept_drafts
    full = lambda logits: jax.lax.all_gather(logits, TP, axis=logits.ndim - 1, tiled=True)
    kv = lambda state: (state.k_pages[-1], state.v_pages[-1])

    def with_mtp(state, kp, vp):
        return dataclasses.replace(state, k_pages=state.k_pages[:-1] + [kp], v_pages=state.v_pages[:-1] + [vp])

    def prefill(weights, state, batch, next_tokens):
        x, state = fw.decoder(cfg, layout, kernels, weights, state, batch)
        first = jnp.argmax(full(fw.lm_head(cfg, weights, fw.last_real(x, batch.lens))), -1).astype(jnp.int32)
        at_end = jnp.arange(next_tokens.shape[1])[None, :] == (batch.lens - 1)[:, None]
        nxt = jnp.where(at_end, first[:, None], next_tokens)
        drafts, kp, vp = fw.draft(cfg, layout, kernels, weights, x, nxt, *kv(state), batch, k)
        return first, drafts, with_mtp(state, kp, vp)

    def spec(weights, state, last, drafts, batch):
        verify = dataclasses.replace(batch, tokens=jnp.concatenate([last[:, None], drafts], 1),
                                     lens=jnp.where(batch.lens > 0, k + 1, 0))
        x, state, pending = fw.decoder(cfg, layout, kernels, weights, state, verify, verify=True)
        logits = full(fw.lm_head(cfg, weights, x))
        z = jnp.zeros((x.shape[0], logits.shape[-1]), jnp.int32)
        tokens, count, _ = accept_drafts(logits, drafts, batch_params(x.shape[0]), z, z.astype(bool), extras=False)
        count = jnp.where(batch.lens > 0, count, 0)
        state = fw.commit(cfg, kernels, weights, state, pending, batch.slots, count)
        mtp_batch = dataclasses.replace(batch, tokens=tokens, lens=count)
        drafts, kp, vp = fw.draft(cfg, layout, kernels, weights, x, tokens, *kv(state), mtp_batch, k)
        return tokens, count, drafts, with_mtp(state, kp, vp)

    def plain(weights, state, batch):
        x, state = fw.decoder(cfg, layout, kernels, weights, state, batch)
        return jnp.argmax(full(fw.lm_head(cfg, weights, x[:, 0])), -1).astype(jnp.int32), state

    sm = lambda f, ins, outs: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=ins, out_specs=outs, check_vma=False),
                                      donate_argnums=1)
    b = fw.BATCH_SPEC
    return (sm(prefill, (w_specs, s_specs, b, P(DP)), (P(DP), P(DP), s_specs)),
            sm(spec, (w_specs, s_specs, P(DP), P(DP), b), (P(DP), P(DP), P(DP), s_specs)),
            sm(plain, (w_specs, s_specs, b), (P(DP), s_specs)))


def batch_params(n):
    return batch(n, temperature=0.0, seed=0)


@pytest.mark.parametrize("tp,k", [(1, 3), (2, 2)])
def test_greedy_speculative_loop_equals_greedy_decoding(tp, k):
    """Prefill, then speculative steps (verify k + 1 tokens, accept greedily, commit, draft k with the trained MTP
    head) produce exactly the tokens of plain greedy decoding, for rows of different prompt lengths; the MTP head
    drafts well enough that steps gain more than one token."""
    from qwen35_jax.model.hub import default_model_dir
    from qwen35_jax.model.state import abstract_state, init_state, state_specs
    from qwen35_jax.model.weights import abstract_weights, weight_specs
    model = default_model_dir()
    cfg = load_config(model)
    mesh, layout = make_mesh(tp), Layout.build(cfg, tp)
    weights = load_weights(model, cfg, mesh, jnp.float32, mtp=True)
    kernels = make_kernels(KernelConfig(backend="reference").resolved())
    n, pages, page_size, steps = 3, 8, 16, 40
    abstract = abstract_state(cfg, layout, n, 1 + n * pages, page_size, jnp.float32, mtp=True)
    w_specs, s_specs = weight_specs(abstract_weights(cfg, layout, jnp.float32, mtp=True)), state_specs(abstract)
    prefill, spec, plain = _programs(cfg, mesh, layout, kernels, k, w_specs, s_specs)
    from qwen35_jax.engine.tokenizer import Tokenizer
    tok = Tokenizer(model)
    texts = ["The list type supports", "Return a new dictionary initialized from an optional positional argument",
             "def"]
    prompts = [tok.encode(t) for t in texts]
    lens = [len(p) for p in prompts]
    t = max(lens)
    ids = np.zeros((n, t), np.int32)
    nxt = np.zeros((n, t), np.int32)
    for i, p in enumerate(prompts):
        ids[i, :len(p)], nxt[i, :len(p) - 1] = p, p[1:]
    table = np.array([1 + i * pages + np.arange(pages) for i in range(n)])
    slots = np.arange(1, n + 1)

    state = init_state(abstract, mesh)
    first, drafts, state = prefill(weights, state, make_batch(ids, [0] * n, lens, slots, table), jnp.asarray(nxt))
    got = [[int(x)] for x in np.asarray(first)]
    last, pos, gained = first, np.array(lens), []
    while min(len(g) for g in got) < steps:
        tokens, count, drafts, state = spec(weights, state, last, drafts, make_batch(ids[:, :1], pos, [1] * n,
                                                                                     slots, table))
        tokens, count = np.asarray(tokens), np.asarray(count)
        for i in range(n):
            got[i] += tokens[i, :count[i]].tolist()
        gained += count.tolist()
        last = jnp.asarray(tokens[np.arange(n), count - 1])
        pos = pos + count

    plain_state = init_state(abstract, mesh)
    first, _, plain_state = prefill(weights, plain_state, make_batch(ids, [0] * n, lens, slots, table),
                                    jnp.asarray(nxt))
    want, cur, pos = [[int(x)] for x in np.asarray(first)], np.asarray(first), np.array(lens)
    for _ in range(steps - 1):
        cur, plain_state = plain(weights, plain_state, make_batch(cur[:, None], pos, [1] * n, slots, table))
        cur = np.asarray(cur)
        for i in range(n):
            want[i].append(int(cur[i]))
        pos = pos + 1
    for i in range(n):
        assert got[i][:steps] == want[i], f"row {i}: speculative {got[i][:steps]} != greedy {want[i]}"
    assert np.mean(gained) > 1.2, f"mean tokens per step {np.mean(gained):.2f}: the MTP head barely drafts"


# -- through the engine (LLM with speculative_config, the trained default model) ---------------------------------
PROMPTS = ["The list type supports", "Return a new dictionary initialized from an optional positional argument",
           "def", "Sockets are"]
SPEC = {"method": "mtp", "num_speculative_tokens": 3}


def _llm(**kw):
    from conftest import engine_args
    from qwen35_jax.llm import LLM
    return LLM(None, **engine_args(precompile=False, **kw))


@pytest.fixture(scope="module")
def spec_llm():
    with _llm(speculative_config=SPEC) as llm:
        yield llm


@pytest.fixture(scope="module")
def plain_llm():
    with _llm() as llm:
        yield llm


def _texts(llm, prompts, params):
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in llm.generate(prompts, params)]


def test_engine_greedy_output_is_unchanged(spec_llm, plain_llm):
    """Greedy outputs with MTP drafts equal plain greedy decoding, with max_tokens off the step grid, a stop string
    and logprobs (the extras sampler), and for a conversation's next turn served from the prefix cache; the drafts
    are accepted often enough that steps gain more than one token, position 1 at least as often as position 3."""
    from qwen35_jax.engine.sampling_params import SamplingParams
    before = spec_llm.engine.stats.spec_steps
    plain = SamplingParams(max_tokens=23, temperature=0.0)
    assert _texts(spec_llm, PROMPTS, plain) == _texts(plain_llm, PROMPTS, plain)
    extras = SamplingParams(max_tokens=30, temperature=0.0, stop=[" the"], logprobs=2)
    got, want = spec_llm.generate(PROMPTS, extras), plain_llm.generate(PROMPTS, extras)
    for a, b in zip(got, want):
        x, y = a.outputs[0], b.outputs[0]
        assert (x.token_ids, x.text, x.finish_reason) == (y.token_ids, y.text, y.finish_reason)
        for lx, ly in zip(x.logprobs, y.logprobs):
            assert lx.keys() == ly.keys() and all(abs(lx[t].logprob - ly[t].logprob) < 1e-4 for t in lx)
    # the next turn of a conversation resumes from the first turn's snapshot (its state ends exactly at its last
    # token: a step keeps no more tokens than max_tokens leaves)
    ids = spec_llm.engine.tokenizer.encode(PROMPTS[1])
    first = spec_llm.generate([ids], plain)[0].outputs[0].token_ids
    turn2 = ids + list(first) + spec_llm.engine.tokenizer.encode(" and then")
    hits = spec_llm.engine.scheduler.prefix_hits
    assert _texts(spec_llm, [turn2], plain) == _texts(plain_llm, [turn2], plain)
    assert spec_llm.engine.scheduler.prefix_hits > hits
    st = spec_llm.engine.stats
    assert st.spec_steps > before and st.spec_accepted[0] >= st.spec_accepted[-1] > 0


def test_a_stop_token_ends_the_step_so_the_next_turn_hits_the_cache(spec_llm, plain_llm):
    """A step keeps nothing after a stop token (and no more than max_tokens leaves), so a request that stopped
    leaves its finish snapshot at its last token, and the conversation's next turn resumes from it."""
    from qwen35_jax.engine.sampling_params import SamplingParams
    tok = spec_llm.engine.tokenizer
    ids = tok.encode(PROMPTS[3])
    free = spec_llm.generate([ids], SamplingParams(max_tokens=30, temperature=0.0))[0].outputs[0].token_ids
    stop = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[free[6]])
    out = spec_llm.generate([ids], stop)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == plain_llm.generate([ids], stop)[0].outputs[0].token_ids
    turn2 = ids + list(out.token_ids) + tok.encode(" and so")
    hits = spec_llm.engine.scheduler.prefix_hits
    params = SamplingParams(max_tokens=12, temperature=0.0)
    assert _texts(spec_llm, [turn2], params) == _texts(plain_llm, [turn2], params)
    assert spec_llm.engine.scheduler.prefix_hits - hits >= len(ids) + len(out.token_ids) - 1


def test_rows_that_end_while_a_step_is_in_flight_keep_exact_state(spec_llm, plain_llm):
    """The host dispatches each speculative step before reading the one before it back. A row that ended in the
    step being read is still in the next one: where the device can tell (a stop token, max_tokens), that step
    keeps nothing for it; where it cannot (a stop string), its snapshot is dropped. Either way the conversation's
    next turn, from the prefix cache or not, equals plain decoding's."""
    from qwen35_jax.engine.sampling_params import SamplingParams
    tok = spec_llm.engine.tokenizer
    ids = tok.encode(PROMPTS[2])
    free = spec_llm.generate([ids], SamplingParams(max_tokens=20, temperature=0.0))[0].outputs[0].token_ids
    params = SamplingParams(max_tokens=8, temperature=0.0)
    stops = [text for at in range(1, 12) if (text := tok.decode(free[at:at + 2]).strip())]
    assert len(stops) >= 4
    for stop in stops:      # stop strings completing at several places in a step
        first = SamplingParams(max_tokens=20, temperature=0.0, stop=[stop])
        out = spec_llm.generate([ids], first)[0].outputs[0]
        assert out.finish_reason == "stop" and out.token_ids == plain_llm.generate([ids], first)[0].outputs[0].token_ids
        turn2 = ids + list(out.token_ids) + tok.encode(" and so")
        assert _texts(spec_llm, [turn2], params) == _texts(plain_llm, [turn2], params), stop
    assert not spec_llm.engine.scheduler.running


def test_seeded_sampling_repeats(spec_llm):
    """Sampled rows (temperature, top-k, penalties, n = 2) repeat under the same seed run to run, and differ under
    another."""
    from qwen35_jax.engine.sampling_params import SamplingParams
    params = lambda seed: SamplingParams(max_tokens=24, temperature=0.8, top_k=20, seed=seed, n=2,
                                         presence_penalty=0.5)
    first = _texts(spec_llm, PROMPTS, params(7))
    assert first == _texts(spec_llm, PROMPTS, params(7)) != _texts(spec_llm, PROMPTS, params(8))


@pytest.mark.parametrize("config,match", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "mtp", "num_speculative_tokens": 5}, "1..4"),
    ({"method": "mtp"}, "1..4"),
    ({"method": "mtp", "num_speculative_tokens": 2, "draft_model": "x"}, "method")])
def test_bad_speculative_configs_are_refused(config, match):
    from qwen35_jax.engine.engine import EngineArgs
    with pytest.raises(ValueError, match=match):
        EngineArgs(speculative_config=config).validate()
    with pytest.raises(ValueError, match="decode_steps"):
        EngineArgs(speculative_config=SPEC, decode_steps=2).validate()


def test_structured_outputs_are_refused_with_drafts(spec_llm):
    from qwen35_jax.engine.sampling_params import SamplingParams, StructuredOutputsParams
    with pytest.raises(ValueError, match="speculative"):
        spec_llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a", "b"])))


def test_engine_greedy_output_is_unchanged_at_tp2(plain_llm):
    """At tp 2 (drafts, verification and commit on sharded weights and state) greedy outputs equal plain decoding's
    (the tp 1 engine's: fp32 logits agree across tp far below these prompts' top-2 gaps). Without the persistent
    compilation cache: a CI run once crashed in JAX's cache write of this engine's executables (not reproduced)."""
    from qwen35_jax.engine.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=14, temperature=0.0)
    with _llm(tensor_parallel_size=2, speculative_config={"method": "mtp", "num_speculative_tokens": 2},
              compilation_cache_dir="") as llm:
        assert _texts(llm, PROMPTS, params) == _texts(plain_llm, PROMPTS, params)

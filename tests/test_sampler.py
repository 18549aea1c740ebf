"""Sampler semantics against numpy: penalties, min_p / top_k / top_p filtering, greedy, logprobs, seeding."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_jax.engine.sampler import MAX_LOGPROBS, SamplingBatch, _filter, apply_penalties, sample


def batch(b, **kw):
    base = dict(temperature=np.ones(b, np.float32), top_k=np.zeros(b, np.int32), top_p=np.ones(b, np.float32),
                min_p=np.zeros(b, np.float32), presence=np.zeros(b, np.float32), frequency=np.zeros(b, np.float32),
                repetition=np.ones(b, np.float32), seed=np.arange(b, dtype=np.uint32), step=np.zeros(b, np.int32),
                logprobs=np.zeros(b, bool))
    base.update({k: np.asarray(v, base[k].dtype) for k, v in kw.items()})
    return SamplingBatch(**base)


def test_penalties():
    logits = np.array([[2.0, -1.0, 0.5, 3.0]], np.float32)
    counts = np.array([[2, 0, 1, 0]], np.int32)
    prompt = np.array([[False, True, False, False]])
    out = apply_penalties(jnp.asarray(logits), batch(1, presence=[0.5], frequency=[0.25], repetition=[2.0]),
                          jnp.asarray(counts), jnp.asarray(prompt))
    x = logits[0] - 0.5 * (counts[0] > 0) - 0.25 * counts[0]
    seen = prompt[0] | (counts[0] > 0)
    want = np.where(seen, np.where(x > 0, x / 2.0, x * 2.0), x)
    np.testing.assert_allclose(out[0], want, rtol=1e-6)


def test_filters_match_numpy():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 50)).astype(np.float32) * 2
    p = batch(4, top_k=[0, 5, 0, 3], top_p=[1.0, 1.0, 0.7, 0.5], min_p=[0.1, 0, 0, 0.2])
    got = np.asarray(_filter(jnp.asarray(x), p))
    for r in range(4):
        keep = np.ones(50, bool)
        probs = np.exp(x[r] - x[r].max())
        probs /= probs.sum()
        keep &= probs >= p.min_p[r] * probs.max()
        if p.top_k[r]:
            keep &= x[r] >= np.sort(x[r])[-p.top_k[r]]
        y = np.where(keep, x[r], -np.inf)
        if p.top_p[r] < 1:
            q = np.exp(y - y.max())
            q /= q.sum()
            order = np.argsort(-y)
            mass_before = np.cumsum(q[order]) - q[order]
            kept = order[mass_before < p.top_p[r]]
            keep2 = np.zeros(50, bool)
            keep2[kept] = True
            y = np.where(keep2, y, -np.inf)
        np.testing.assert_array_equal(np.isfinite(got[r]), np.isfinite(y), err_msg=f"row {r}")


def test_sample_greedy_seeded_and_logprobs():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.standard_normal((3, 40)).astype(np.float32))
    zeros_c, zeros_m = jnp.zeros((3, 40), jnp.int32), jnp.zeros((3, 40), bool)
    p = batch(3, temperature=[0.0, 1.0, 1.0], seed=[7, 7, 8], logprobs=[True, False, False])
    tok, lp = sample(logits, p, zeros_c, zeros_m)
    assert int(tok[0]) == int(jnp.argmax(logits[0]))
    ref_lp = jax.nn.log_softmax(logits, -1)
    np.testing.assert_allclose(lp["logprob"], ref_lp[jnp.arange(3), tok], rtol=1e-5)
    assert lp["top_ids"].shape == (3, MAX_LOGPROBS)
    np.testing.assert_array_equal(lp["top_ids"][0], np.argsort(-np.asarray(ref_lp[0]))[:MAX_LOGPROBS])
    # the same (seed, step) gives the same draw whatever the row and batch; another step or seed differs
    tok_b, _ = sample(logits[1:2], batch(1, seed=[7]), zeros_c[:1], zeros_m[:1])
    assert int(tok_b[0]) == int(tok[1])
    draws = {int(sample(logits[1:2], batch(1, seed=[7], step=[s]), zeros_c[:1], zeros_m[:1])[0][0]) for s in range(30)}
    assert len(draws) > 3


def test_sampling_distribution_follows_temperature():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.2]], jnp.float32))
    z = jnp.zeros((1, 3), jnp.int32), jnp.zeros((1, 3), bool)
    base = batch(1, seed=[3])
    f = jax.jit(lambda s: sample(logits, dataclasses.replace(base, step=s), *z)[0][0])
    draws = np.array([int(f(jnp.array([i], jnp.int32))) for i in range(2000)])
    freq = np.bincount(draws, minlength=3) / len(draws)
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.2], atol=0.04)


def test_top_k_desc_by_levels_is_exact():
    from qwen35_jax.engine.sampler import top_k_desc
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 70001)).astype(np.float32)  # 547 blocks of 128, the last one partial
    x[1, 69990:] = -np.inf                                  # padding columns, as in the model's logits
    x[2, [7, 4000, 70000]] = 9.0                            # ties at the top, in different blocks
    x[3, 256:384] = 5.0 + np.arange(128) / 1e3              # the whole top 128 in one block
    for k, blocks in [(1, (16, 8, 8)), (20, (16, 8, 8)), (128, (16, 8, 8)), (128, (16, 8)), (20, (16, 16, 8)),
                      (128, (8, 8, 8, 4))]:         # coarsest levels of more and of fewer than k blocks
        vals, idx = top_k_desc(jnp.asarray(x), k, blocks)
        want = -np.sort(-x, axis=-1)[:, :k]
        np.testing.assert_array_equal(np.asarray(vals), want)
        np.testing.assert_array_equal(np.take_along_axis(x, np.asarray(idx), axis=-1), want)
        assert all(len(set(r)) == k for r in np.asarray(idx).tolist())


def test_candidate_filter_equals_full_sort():
    """Where the host routes a batch to the candidates executable, its thresholds are those of the full sort."""
    from qwen35_jax.engine.sampler import CANDIDATES, needs_full_vocab
    rng = np.random.default_rng(4)
    v = 6000
    x = (rng.standard_normal((8, v)) * rng.uniform(0.5, 4, (8, 1))).astype(np.float32)
    x[3, :50] = x[3, 50]                                    # a tie spanning the top-k boundary
    p = batch(8, top_k=[0, 1, 20, 40, CANDIDATES, 20, 0, 5], top_p=[1.0, 0.5, 0.8, 0.95, 0.9, 1.0, 1.0, 0.3],
              min_p=[0.05, 0, 0, 0.1, 0, 0.2, 0.0, 0.01])
    assert not needs_full_vocab(p)
    full = np.asarray(_filter(jnp.asarray(x), p, full_vocab=True))
    cand = np.asarray(_filter(jnp.asarray(x), p, full_vocab=False))
    np.testing.assert_array_equal(np.isfinite(cand), np.isfinite(full))
    assert np.isfinite(full[0]).sum() > CANDIDATES          # min_p alone keeps more than the candidates


def test_needs_full_vocab_routing():
    from qwen35_jax.engine.sampler import CANDIDATES, needs_full_vocab
    assert not needs_full_vocab(batch(2, temperature=[0.0, 0.0], top_p=[0.5, 0.5]))          # greedy ignores filters
    assert not needs_full_vocab(batch(2, top_k=[20, 0], top_p=[0.8, 1.0], min_p=[0, 0.1]))
    assert needs_full_vocab(batch(2, top_k=[20, 0], top_p=[0.8, 0.9]))                        # nucleus unbounded
    assert needs_full_vocab(batch(1, top_k=[CANDIDATES + 1]))


def test_sampler_mode_routing_and_lean_tokens():
    """Batches without penalties or logprobs run the lean sampler (all-greedy ones the argmax alone): the same
    tokens as the sampler with extras."""
    from qwen35_jax.engine.sampler import sampler_mode
    assert sampler_mode(batch(2, top_k=[20, 0], top_p=[0.8, 1.0])) == "lean"
    assert sampler_mode(batch(2, temperature=[0.0, 0.7])) == "lean"
    assert sampler_mode(batch(2, temperature=[0.0, 0.0], top_k=[20, 0], top_p=[0.5, 1.0])) == "greedy"
    assert sampler_mode(batch(2, temperature=[0.0, 0.0], logprobs=[True, False])) == "top"
    assert sampler_mode(batch(2, temperature=[0.0, 0.0], repetition=[1.0, 1.2])) == "top"
    assert sampler_mode(batch(2, top_k=[20, 0], top_p=[0.8, 1.0], logprobs=[False, True])) == "top"
    for kw in (dict(presence=[0, 0.5]), dict(frequency=[0.1, 0]), dict(repetition=[1.0, 1.1])):
        assert sampler_mode(batch(2, **kw)) == "top", kw
    assert sampler_mode(batch(2, top_k=[20, 0], top_p=[0.8, 0.9], presence=[0, 0.5])) == "full"
    rng = np.random.default_rng(6)
    logits = jnp.asarray(rng.standard_normal((6, 3000)).astype(np.float32) * 3)
    p = batch(6, temperature=[0.0, 0.7, 1.0, 0.7, 1.3, 0.0], top_k=[0, 20, 0, 5, 100, 0],
              top_p=[1.0, 0.8, 1.0, 0.9, 0.95, 1.0], min_p=[0, 0, 0.05, 0, 0, 0], step=[0, 3, 1, 7, 2, 9])
    assert sampler_mode(p) == "lean"
    c, m = jnp.zeros((6, 3000), jnp.int32), jnp.zeros((6, 3000), bool)
    full, _ = sample(logits, p, c, m, full_vocab=False)
    lean, lp = sample(logits, p, c, m, full_vocab=False, extras=False)
    np.testing.assert_array_equal(np.asarray(lean), np.asarray(full))
    assert lp["top_ids"].shape == (6, MAX_LOGPROBS) and not np.any(np.asarray(lp["logprob"]))
    g = dataclasses.replace(p, temperature=np.zeros(6, np.float32))
    assert sampler_mode(g) == "greedy"
    greedy, lp = sample(logits, g, c, m, full_vocab=False, greedy_only=True)
    np.testing.assert_array_equal(np.asarray(greedy), np.asarray(sample(logits, g, c, m, full_vocab=True)[0]))
    np.testing.assert_array_equal(np.asarray(greedy), np.argmax(np.asarray(logits), -1))
    assert not np.any(np.asarray(lp["logprob"]))


def test_draw_is_exact_on_a_grid_of_uniforms():
    """Over a 200 x 200 grid of (u0, u1) the two-level inverse CDF picks each kept token with its probability (to the
    grid's resolution), never a removed or padding one; blocks of 128 with a partial last block."""
    from qwen35_jax.engine.sampler import draw
    rng = np.random.default_rng(5)
    v = 300
    x = (rng.standard_normal(v) * 1.5).astype(np.float32)
    x[290:] = -np.inf                                       # padding columns
    cut = np.float32(np.sort(x[:290])[-60])                 # keep the top 60, spread over the three blocks
    g = (np.arange(200) + 0.5) / 200
    u = np.stack(np.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2).astype(np.float32)
    n = len(u)
    xs = jnp.broadcast_to(jnp.asarray(x), (n, v))
    tok = np.asarray(draw(xs, jnp.full((n, 1), cut), jnp.full((n, 1), x.max()), jnp.asarray(u)))
    w = np.where(x >= cut, np.exp(x - x.max()), 0.0)
    freq = np.bincount(tok, minlength=v) / n
    assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(w))
    np.testing.assert_allclose(freq, w / w.sum(), atol=2.5 / 200)


def test_candidate_and_full_vocab_sampling_agree():
    """The same seeded draws whichever decode executable (candidates or full sort) a batch runs."""
    from qwen35_jax.engine.sampler import CANDIDATES
    rng = np.random.default_rng(6)
    v = 5000
    logits = jnp.asarray((rng.standard_normal((6, v)) * 2).astype(np.float32))
    p = batch(6, temperature=[0.0, 0.7, 1.0, 1.3, 0.9, 1.0], top_k=[0, 20, 0, CANDIDATES, 1, 50],
              top_p=[1.0, 0.8, 1.0, 0.9, 1.0, 0.95], min_p=[0, 0, 0.05, 0, 0, 0], seed=[1, 2, 3, 4, 5, 6],
              logprobs=[True] * 6)
    z = jnp.zeros((6, v), jnp.int32), jnp.zeros((6, v), bool)
    for step in range(5):
        q = dataclasses.replace(p, step=np.full(6, step, np.int32))
        a, lp_a = sample(logits, q, *z, full_vocab=False)
        b, lp_b = sample(logits, q, *z, full_vocab=True)
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(lp_a["rank"], lp_b["rank"])
        ref = np.asarray(jax.nn.log_softmax(logits, -1))
        np.testing.assert_array_equal(lp_a["rank"], 1 + (ref > ref[np.arange(6), np.asarray(a)][:, None]).sum(-1))

"""Mixed steps (issue 39): decode rows and a prefill chunk in one forward (forward.decoder_groups) leave the model
where the two run apart do, and an engine that mixes generates what one that does not generates."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import fixture_dir
from qwen35_jax.model.backends import KernelConfig, make_kernels
from qwen35_jax.model.config import load_config
from qwen35_jax.model.forward import BATCH_SPEC, decoder_groups
from qwen35_jax.model.runner import ModelRunner, make_batch
from qwen35_jax.model.sharding import DP, Layout, make_mesh
from qwen35_jax.model.weights import load_weights


@pytest.mark.parametrize("backend,tp", [("reference", 1), ("reference", 2), ("pallas_interpret", 1)])
def test_groups_equal_separate_passes(backend, tp):
    """Two requests decoding (slots 1, 2) and a 40-token chunk of a third (slot 3, continuing mid-page from 20
    tokens): one pass over both groups gives each group's hidden states and the new state (GDN pools, K/V pages)
    of a prefill pass followed by a decode pass, to 1e-5 (fp32)."""
    model = fixture_dir("mm_tied_r2_g2")
    cfg = load_config(model)
    mesh = make_mesh(tp)
    layout = Layout.build(cfg, tp)
    weights = load_weights(model, cfg, mesh, jnp.float32)
    kernels = make_kernels(KernelConfig(backend=backend).resolved())
    ps, per_row = 16, 8
    runner = ModelRunner(cfg, mesh, layout, weights, jnp.float32, kernels, num_slots=3, num_pages=1 + 3 * per_row,
                         page_size=ps)
    table = np.array([1 + i * per_row + np.arange(per_row) for i in range(3)])
    rng = np.random.default_rng(0)
    lens = np.array([37, 16, 20])                          # the context each request has before the step
    tokens = np.zeros((3, 37), int)
    for i, n in enumerate(lens):
        tokens[i, :n] = rng.integers(0, cfg.vocab_size, n)
    runner.run(make_batch(tokens, [0, 0, 0], lens, [1, 2, 3], table))
    dec = make_batch([[5], [9]], lens[:2], [1, 1], [1, 2], table[:2])
    pre = make_batch(rng.integers(0, cfg.vocab_size, (1, 40)), lens[2:], [40], [3], table[2:])

    def run(state, batches):
        body = lambda w, s, bs: decoder_groups(cfg, layout, kernels, w, s, bs)
        fn = jax.shard_map(body, mesh=mesh, in_specs=(runner._w_specs, runner._s_specs, (BATCH_SPEC,) * len(batches)),
                           out_specs=([P(DP)] * len(batches), runner._s_specs), check_vma=False)
        return jax.jit(fn)(weights, state, tuple(batches))

    (xp,), state = run(runner.state, [pre])
    (xd,), apart = run(state, [dec])
    (md, mp), mixed = run(runner.state, [dec, pre])
    for got, want in [(md, xd), (mp, xp)] + list(zip(jax.tree.leaves(mixed), jax.tree.leaves(apart))):
        got, want = np.asarray(got), np.asarray(want)
        np.testing.assert_allclose(got, want, atol=1e-5 * max(1.0, np.abs(want).max()), rtol=0)


def test_engine_mixes_prefill_into_decode_steps():
    """With decode_prefill_budget, a long prompt's chunks run inside the decode steps of the requests already
    decoding (mixed steps), and every request's output, greedy or seeded, is what an engine without mixed steps
    gives (the precompiled test engine of test_engine.py). A plain engine runs no mixed step."""
    from test_engine import GREEDY, llm, prompts
    from qwen35_jax.engine.sampling_params import SamplingParams
    from qwen35_jax.llm import LLM
    from conftest import engine_args
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    ps = prompts(3, seed=5) + [np.random.default_rng(1).integers(2, 250, 200).tolist()]
    params = [GREEDY, seeded, GREEDY, GREEDY]
    want = [o.outputs[0].token_ids for o in llm(1).generate(ps, params)]
    assert llm(1).engine.stats.mixed_steps == 0
    model = LLM(fixture_dir("text_untied_r1_g6"), skip_tokenizer_init=True,
                **engine_args(precompile=False, decode_prefill_budget=32))
    assert model.engine.executor.mixed_shapes == ((1, 32),)
    got = [o.outputs[0].token_ids for o in model.generate(ps, params)]
    assert got == want
    assert model.engine.stats.mixed_steps >= 4           # the 200-token prompt: 64 tokens alone, then 32 a step

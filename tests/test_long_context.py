"""Long prompts in chunks (issue 39): a prompt prefilled in many chunks leaves the model exactly where one chunk
does, with the prefill attention kernel (interpret mode) and with the jnp reference."""
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import fixture_dir
from qwen35_jax.model.backends import KernelConfig, make_kernels
from qwen35_jax.model.config import load_config
from qwen35_jax.model.runner import ModelRunner, make_batch
from qwen35_jax.model.sharding import Layout, make_mesh
from qwen35_jax.model.weights import load_weights


@pytest.mark.parametrize("backend", ["reference", "pallas_interpret"])
def test_many_chunks_equal_one(backend):
    """Two prompts (600 and 350 tokens) prefilled side by side, in one chunk each, then in chunks of other lengths
    that start mid-page and end at other places in each row (varlen batches); the last position's logits and the
    next decode step's agree to 1e-5 (fp32)."""
    model = fixture_dir("mm_tied_r2_g2")
    cfg = load_config(model)
    mesh = make_mesh(1)
    weights = load_weights(model, cfg, mesh, jnp.float32)
    layout = Layout.build(cfg, 1)
    kernels = make_kernels(KernelConfig(backend=backend).resolved())
    ps, per_row = 16, 40                                   # 640 positions per row
    lens = np.array([600, 350])
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 600))
    table = np.array([1 + i * per_row + np.arange(per_row) for i in range(2)])
    slots = [1, 2]

    def run(chunks):
        r = ModelRunner(cfg, mesh, layout, weights, jnp.float32, kernels, num_slots=2, num_pages=1 + 2 * per_row,
                        page_size=ps)
        done, last = np.zeros(2, int), None
        for c in chunks:                                   # c: tokens each row takes this call
            t = max(c)
            tokens = np.zeros((2, t), int)
            for i in range(2):
                tokens[i, :c[i]] = prompts[i, done[i]:done[i] + c[i]]
            logits = np.asarray(r.run(make_batch(tokens, done, c, slots, table)))[..., :cfg.vocab_size]
            last = [logits[i] if done[i] + c[i] == lens[i] and c[i] else
                    (last[i] if last is not None else None) for i in range(2)]
            done += c
        assert (done == lens).all()
        nxt = make_batch([[5], [7]], lens, [1, 1], slots, table)
        return np.stack(last), np.asarray(r.run(nxt))[..., :cfg.vocab_size]

    one = run([lens])
    many = run([np.array([100, 37]), np.array([163, 200]), np.array([300, 113]), np.array([37, 0])])
    scale = np.abs(one[0]).max()
    for a, b in zip(one, many):
        np.testing.assert_allclose(b, a, atol=1e-5 * scale, rtol=0)

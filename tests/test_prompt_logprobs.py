"""Prompt logprobs (SamplingParams.prompt_logprobs) through the engine, against the model's full-forward logits."""
import numpy as np
import pytest

from conftest import engine_args
from qwen35_jax.engine.sampling_params import SamplingParams
from qwen35_jax.llm import LLM

K = 5
# chunks of up to 64 tokens (max_num_batched_tokens): the long prompt is prefilled in 3 steps
PROMPT = np.random.default_rng(0).integers(2, 1000, size=150).tolist()
# fp32 logprobs of ~-10: chunked prefill and the full forward sum in other orders (2.4e-4 apart seen on CI's CPU)
TOL = 1e-3


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with LLM(tiny_model_dir, **engine_args(precompile=False)) as model:
        yield model


@pytest.fixture(scope="module")
def reference(llm):
    """log_softmax of the full-forward logits of PROMPT (every test prompt is a prefix of it: causal)."""
    x = llm.logits(PROMPT).astype(np.float64)
    return x - (x.max(-1, keepdims=True) + np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)))


def check(prompt, plp, ref, k=K):
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    for pos in range(1, len(prompt)):
        entry, want, tok = plp[pos], ref[pos - 1], prompt[pos]
        assert tok in entry and all(e.decoded_token is not None for e in entry.values())
        assert entry[tok].logprob == pytest.approx(want[tok], abs=TOL)
        # rank: 1 + the tokens strictly more likely (up to near-ties)
        assert (want > want[tok] + TOL).sum() <= entry[tok].rank - 1 <= (want > want[tok] - TOL).sum()
        top = sorted(((e.rank, t, e.logprob) for t, e in entry.items() if t != tok or e.rank <= k))
        if entry[tok].rank > k:
            assert len(entry) == k + 1
        assert [r for r, _, _ in top] == list(range(1, k + 1))
        lps = [lp for _, _, lp in top]
        assert lps == sorted(lps, reverse=True)
        assert np.allclose(lps, np.sort(want)[::-1][:k], atol=TOL)
        assert np.allclose(lps, want[[t for _, t, _ in top]], atol=TOL)
        if entry[tok].rank == 1:
            assert top[0][1] == tok


def test_chunked_prompt(llm, reference, caplog):
    with caplog.at_level("INFO", logger="qwen35_jax.engine.executor"):
        out = llm.generate(PROMPT, SamplingParams(prompt_logprobs=K, max_tokens=1, temperature=0))[0]
    check(PROMPT, out.prompt_logprobs, reference)
    assert out.outputs[0].token_ids == [int(np.argmax(reference[-1]))]
    # 64 + 64 + 22 tokens, each chunk in a prompt-logprobs variant compiled on first use (logged once)
    assert {("prompt_logprobs", 1, 64), ("prompt_logprobs", 1, 32)} <= set(llm.engine.executor.compiled)
    assert sum("prompt-logprobs variant" in r.getMessage() for r in caplog.records) == 1


def test_two_rows_one_batch(llm, reference):
    prompts = [PROMPT[:11], PROMPT[:23]]
    outs = llm.generate(prompts, SamplingParams(prompt_logprobs=K, max_tokens=1, temperature=0))
    for p, out in zip(prompts, outs):
        check(p, out.prompt_logprobs, reference)
    zero = llm.generate(PROMPT[:7], SamplingParams(prompt_logprobs=0, max_tokens=1))[0].prompt_logprobs
    assert [list(e) for e in zero[1:]] == [[t] for t in PROMPT[1:7]]


def test_mixed_batch_and_n(llm):
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    alone = llm.generate(PROMPT[:30], greedy)[0]
    assert alone.prompt_logprobs is None
    mixed = llm.generate([PROMPT[:17], PROMPT[:30]], [SamplingParams(prompt_logprobs=2, max_tokens=1), greedy])
    assert mixed[1].prompt_logprobs is None and mixed[0].prompt_logprobs is not None
    assert mixed[1].outputs[0].token_ids == alone.outputs[0].token_ids
    n = llm.generate(PROMPT[:17], SamplingParams(n=2, prompt_logprobs=2, max_tokens=2, seed=1))[0]
    assert len(n.outputs) == 2
    # the same tokens and ranks; logprobs equal up to float noise (other batch shapes, other matmul blockings: which
    # bucket a request lands in depends on when the engine thread picks it up; 1.07e-4 was seen on a logprob of -2.78)
    assert len(n.prompt_logprobs) == len(mixed[0].prompt_logprobs) and n.prompt_logprobs[0] is None
    for got, want in zip(n.prompt_logprobs[1:], mixed[0].prompt_logprobs[1:]):
        assert {t: e.rank for t, e in got.items()} == {t: e.rank for t, e in want.items()}
        assert [got[t].logprob for t in want] == pytest.approx([e.logprob for e in want.values()], abs=5e-4)


@pytest.mark.parametrize("bad", [21, -1, "3"])
def test_bad_values(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)

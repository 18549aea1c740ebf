"""Text-level generation on the embedded tiny model: stop strings and tokens, streaming, async API, n, chat."""
import asyncio

import pytest

from conftest import engine_args, settled
from qwen35_jax.llm import LLM
from qwen35_jax.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, **engine_args(dtype="bfloat16", max_num_seqs=4, precompile=False))


GREEDY = dict(temperature=0, ignore_eos=True)


def test_stop_string_truncates_and_reports(llm):
    full = llm.generate("Hello world", SamplingParams(max_tokens=24, **GREEDY))[0].outputs[0]
    assert len(full.text) > 12
    stop = full.text[6:10]
    out = llm.generate("Hello world", SamplingParams(max_tokens=24, stop=[stop, "never-seen"], **GREEDY))[0].outputs[0]
    assert out.text == full.text[:full.text.find(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_stop_token_ids_and_eos(llm):
    full = llm.generate("Hello world", SamplingParams(max_tokens=10, **GREEDY))[0].outputs[0]
    stop_tok = full.token_ids[3]
    first = full.token_ids.index(stop_tok)
    out = llm.generate("Hello world", SamplingParams(max_tokens=10, stop_token_ids=[stop_tok], **GREEDY))[0].outputs[0]
    assert out.token_ids == full.token_ids[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_tok)
    # with the first generated token made an EOS id, generation stops there unless ignore_eos
    llm.engine.eos_token_ids.add(full.token_ids[0])
    try:
        eos = llm.generate("Hello world", SamplingParams(max_tokens=10, temperature=0))[0].outputs[0]
        assert eos.token_ids == full.token_ids[:1] and eos.finish_reason == "stop" and eos.stop_reason is None
        assert llm.generate("Hello world", SamplingParams(max_tokens=10, **GREEDY))[0].outputs[0].token_ids \
            == full.token_ids
    finally:
        llm.engine.eos_token_ids.discard(full.token_ids[0])


def test_n_and_logprobs(llm):
    out = llm.generate("Once", SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=3, logprobs=2,
                                              ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        assert len(c.logprobs) == 8
        for tok, entry in zip(c.token_ids, c.logprobs):
            assert tok in entry and len(entry) >= 2 and entry[tok].logprob <= 0
            ranks = sorted(e.rank for t, e in entry.items() if t != tok)
            assert ranks[:2] == [1, 2] or entry[tok].rank in (1, 2)
        assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)),
                                                     rel=1e-5)
    again = llm.generate("Once", SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=3, ignore_eos=True))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]   # lean sampler: same tokens
    assert all(c.logprobs is None and c.cumulative_logprob is None for c in again.outputs)   # as vLLM


def test_async_streaming_inside_running_loop(llm):
    async def run():
        seen = []
        async for out in llm.generate_async("Hello", SamplingParams(max_tokens=12, **GREEDY)):
            seen.append((len(out.outputs[0].token_ids), out.outputs[0].text, out.finished))
        return seen

    seen = asyncio.run(run())
    assert seen[-1][2] and seen[-1][0] == 12
    assert len(seen) >= 3 and all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))
    final = llm.generate("Hello", SamplingParams(max_tokens=12, **GREEDY))[0].outputs[0]
    assert seen[-1][1] == final.text


def test_cancelled_stream_aborts_and_frees(llm):
    sched = settled(llm.engine)
    free = len(sched.free_slots)

    async def run():
        async for out in llm.generate_async("Hello", SamplingParams(max_tokens=200, **GREEDY)):
            if len(out.outputs[0].token_ids) >= 2:
                break

    asyncio.run(run())
    for _ in range(100):
        if len(sched.free_slots) == free:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert len(sched.free_slots) == free and not sched.running


def test_chat_template_from_model_dir(llm):
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=5, **GREEDY),
                   chat_template_kwargs={"enable_thinking": False})
    assert out[0].prompt == text and len(out[0].outputs[0].token_ids) == 5

"""Structured outputs through the engine (llguidance grammars as a token bitmask in the compiled sampler)."""
import json
import re

import jsonschema
import numpy as np
import pytest

from conftest import engine_args
from qwen35_jax.engine.sampler import allowed_tokens
from qwen35_jax.engine.sampling_params import SamplingParams, StructuredOutputsParams
from qwen35_jax.llm import LLM

# bounded: a random-weight model must still close it (the grammar alone guarantees the output)
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0,
                                                                             "maximum": 99},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
                         "ok": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with LLM(tiny_model_dir, **engine_args(precompile=False)) as model:
        yield model


def test_allowed_tokens_unpacks_llguidance_layout():
    rng = np.random.default_rng(0)
    mask = rng.integers(-2**31, 2**31, size=(3, 5), dtype=np.int64).astype(np.int32)
    want = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[:, :150].astype(bool)
    assert (np.asarray(allowed_tokens(mask, 150)) == want).all()


def constrained(**kw):
    return StructuredOutputsParams(**kw)


def test_json_schema_holds_for_every_seeded_sample(llm):
    params = SamplingParams(n=6, temperature=1.0, seed=5, max_tokens=80, structured_outputs=constrained(json=SCHEMA))
    outs = llm.generate(["Give me a record:", "x y z"], params)
    texts = [c.text for o in outs for c in o.outputs]
    assert len(texts) == 12 and len(set(texts)) > 1
    for o in outs:
        for c in o.outputs:
            jsonschema.validate(json.loads(c.text), SCHEMA)
            assert c.finish_reason == "stop"


def test_regex_choice_grammar_and_json_object(llm):
    sp = lambda seed, **kw: SamplingParams(temperature=1.0, seed=seed, max_tokens=24,
                                           structured_outputs=constrained(**kw))
    for seed in range(3):
        out = llm.generate(["a", "b", "c", "d"], [sp(seed, regex=r"[0-9]{3}-[a-z]{2}"),
                                                  sp(seed, choice=["yes", "no", 'say "hi"']),
                                                  sp(seed, grammar='start: "(" NUM ")"\nNUM: /[1-9][0-9]?/'),
                                                  sp(seed, json_object=True)])
        regex, choice, grammar, obj = (o.outputs[0] for o in out)
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", regex.text) and regex.finish_reason == "stop"
        assert choice.text in ("yes", "no", 'say "hi"')
        assert re.fullmatch(r"\([1-9][0-9]?\)", grammar.text)
        assert obj.finish_reason == "length" or isinstance(json.loads(obj.text), dict)


def test_unconstrained_rows_beside_constrained_ones_are_unchanged(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate("The quick brown", greedy)[0].outputs[0].token_ids
    both = llm.generate(["The quick brown", "Hi"], [greedy, SamplingParams(
        temperature=0, max_tokens=12, structured_outputs=constrained(choice=["alpha", "beta"]))])
    assert both[0].outputs[0].token_ids == alone and both[1].outputs[0].text in ("alpha", "beta")


def test_greedy_constrained_tokens_are_the_masked_argmax(llm):
    """Each token of a greedy constrained generation is the argmax of the full forward's logits over the tokens
    the grammar allows after the tokens before it (the engine decodes constrained rows in a split step)."""
    spec = constrained(regex=r"[a-z]{2,5}( [a-z]{2,5}){3}")
    prompt = list(range(5, 17))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec))[0].outputs[0]
    assert re.fullmatch(r"[a-z]{2,5}( [a-z]{2,5}){3}", out.text) and out.finish_reason == "stop"
    matcher, ids = llm.engine.grammar(spec), list(prompt)
    for tok in out.token_ids:
        logits = llm.logits(ids)[-1]
        allowed = np.asarray(allowed_tokens(llm.engine._grammars.bitmask([matcher]), logits.shape[-1]))[0]
        masked = np.where(allowed, logits, -np.inf)
        assert allowed[tok] and masked[tok] >= masked.max() - 1e-4
        assert matcher.consume_token(tok)
        ids.append(tok)


@pytest.mark.parametrize("kw,match", [
    (dict(regex="a(b"), "invalid grammar"), (dict(grammar="start: undefined_rule"), "invalid grammar"),
    (dict(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}), "invalid grammar")])
def test_invalid_grammars_are_refused(llm, kw, match):
    with pytest.raises(ValueError, match=match):
        llm.generate("x", SamplingParams(structured_outputs=constrained(**kw)))
    assert llm.generate("x", SamplingParams(max_tokens=2))[0].outputs[0].finish_reason == "length"


def test_each_sequence_gets_its_own_compiled_matcher(llm):
    """Matchers are compiled per sequence, never copied (llguidance's copies share a lexer behind one lock, which
    made the parallel batch mask fill a serial one); a caller may hand add_request matchers it compiled."""
    import threading
    engine, spec = llm.engine, constrained(choice=["yes", "no"])
    a, b = engine.grammar(spec), engine.grammar(spec)
    assert a is not b and a.consume_tokens(llm.tokenizer.encode("yes")) and a.is_accepting() and not b.is_accepting()
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4, structured_outputs=spec)
    mine, done, final = [engine.grammar(spec) for _ in range(3)], threading.Event(), []
    with pytest.raises(ValueError, match="2 compiled grammars for n=3"):
        engine.add_request("q", params, lambda out: None, matchers=mine[:2])
    engine.add_request("q", params, lambda out: (final.append(out), done.set()), stream=False, matchers=mine)
    assert done.wait(120)
    assert all(c.text in ("yes", "no") for c in final[0].outputs)
    assert all(m.is_accepting() for m in mine)          # these matchers constrained the three sequences


@pytest.mark.parametrize("kw", [{}, dict(regex="a", choice=["b"]), dict(choice=[]), dict(json="{not json")])
def test_params_need_exactly_one_valid_constraint(kw):
    with pytest.raises(ValueError, match="structured outputs"):
        StructuredOutputsParams(**kw)


# -- through the server (in-process app over the same engine, the `openai` SDK as client) -------------------------
@pytest.fixture(scope="module")
def client(llm, tiny_model_dir):
    import openai
    from fastapi.testclient import TestClient
    from prometheus_client import CollectorRegistry

    from qwen35_jax.server.app import ServerConfig, create_app
    app = create_app(llm.engine, ServerConfig(served_model_names=["tiny"], model_path=tiny_model_dir),
                     CollectorRegistry())
    with TestClient(app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)


def test_server_json_schema_response_validates_every_sample(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}
    args = dict(model="tiny", messages=[{"role": "user", "content": "A record, please."}], response_format=fmt,
                n=4, temperature=1.0, seed=11, max_tokens=80, extra_body={"chat_template_kwargs": {
                    "enable_thinking": False}})
    out = client.chat.completions.create(**args)
    for c in out.choices:
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
        assert c.finish_reason == "stop"
    texts = {}
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert sorted(texts) == [0, 1, 2, 3]
    for text in texts.values():
        jsonschema.validate(json.loads(text), SCHEMA)


def test_server_thinking_then_json(client):
    """Thinking on: the output may reason until </think> first; the content after it is the constrained JSON."""
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "A record."}],
                                         response_format={"type": "json_object"}, max_tokens=6, temperature=0)
    c = out.choices[0]
    assert c.finish_reason == "length" and c.message.content == "" and c.message.reasoning_content is not None


def test_server_completions_guided_fields(client):
    for extra in ({"guided_choice": ["red", "green"]}, {"structured_outputs": {"choice": ["red", "green"]}}):
        out = client.completions.create(model="tiny", prompt="Colour:", max_tokens=8, temperature=1.0, n=3, seed=2,
                                        extra_body=extra)
        assert all(c.text in ("red", "green") and c.finish_reason == "stop" for c in out.choices)
    out = client.completions.create(model="tiny", prompt="Code:", max_tokens=12, temperature=1.0, seed=4,
                                    extra_body={"guided_regex": r"[A-Z]{2}-\d{2}"})
    assert re.fullmatch(r"[A-Z]{2}-\d{2}", out.choices[0].text)


def test_split_steps_compile_in_the_background(tiny_model_dir):
    """A precompiled engine compiles the split decode steps when the first constrained request arrives, in a
    background thread; meanwhile constrained rows run the regular decode executables, reading each step back
    first. Both paths give the same tokens."""
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    with LLM(tiny_model_dir, **engine_args(precompile=False, max_num_seqs=2)) as model:
        ex = model.engine.executor
        for key in ex.keys():   # what greedy rows use: every prefill bucket, the greedy decode ones, the copies
            if key[0] != "decode" or key[2] == "greedy":
                ex.compiled[key] = ex._compile(key)
        ex.lazy = False            # as after the precompile sweep: nothing more is compiled on the serving path
        assert not ex.split_ready
        params = SamplingParams(temperature=0, max_tokens=30, structured_outputs=constrained(json=SCHEMA))
        before = [o.outputs[0].token_ids for o in model.generate(prompts, params)]
        ex.wait_split(timeout=900)
        assert ex.split_ready and set(ex.split_keys()) <= set(ex.compiled)
        assert [o.outputs[0].token_ids for o in model.generate(prompts, params)] == before

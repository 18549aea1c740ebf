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


@pytest.mark.parametrize("kw,match", [
    (dict(regex="a(b"), "invalid grammar"), (dict(grammar="start: undefined_rule"), "invalid grammar"),
    (dict(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}), "invalid grammar")])
def test_invalid_grammars_are_refused(llm, kw, match):
    with pytest.raises(ValueError, match=match):
        llm.generate("x", SamplingParams(structured_outputs=constrained(**kw)))
    assert llm.generate("x", SamplingParams(max_tokens=2))[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("kw", [{}, dict(regex="a", choice=["b"]), dict(choice=[]), dict(json="{not json")])
def test_params_need_exactly_one_valid_constraint(kw):
    with pytest.raises(ValueError, match="structured outputs"):
        StructuredOutputsParams(**kw)

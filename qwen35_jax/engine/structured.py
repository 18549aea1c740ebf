"""Structured outputs: grammars compiled by llguidance, applied as a token bitmask inside the compiled sampler.

Every constrained sequence holds an llguidance `LLMatcher`, its grammar's parser state. Before a step samples such a
row the engine fills the row's bitmask (one bit per token of the padded vocabulary, int32 [rows, ceil(V / 32)], the
layout llguidance writes) from the matcher, in parallel over rows on llguidance's own threads; the bitmask is an input
of every compiled step (sampler.allowed_tokens), and unconstrained rows carry an all-ones mask (how decode overlaps
the mask with the model step: executor's docstring). After the step the sampled token advances the matcher.
llguidance rather than xgrammar: it needs no torch, and its mask cost and JSON-schema coverage were measured side
by side (bench/grammar_mask.py).

JSON is generated compact (", " and ": " separators, no free whitespace): with free whitespace a model can loop on
blank lines until max_tokens and never close the object.
"""
from __future__ import annotations

import collections
import json
import threading

import numpy as np

from qwen35_jax.engine.sampling_params import StructuredOutputsParams

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def lark_literal(text: str) -> str:
    """A Lark string literal matching `text` exactly."""
    return json.dumps(text, ensure_ascii=False)


def json_expression(schema: dict) -> str:
    """A Lark expression for JSON text valid under `schema`, laid out as JSON_OPTIONS says (a schema's own
    "x-guidance" options win)."""
    return "%json " + json.dumps({"x-guidance": JSON_OPTIONS, **schema}, ensure_ascii=False)


def lark_grammar(spec: StructuredOutputsParams, prefix: str = "") -> str:
    """The constraint as a Lark grammar whose start rule is `prefix` (Lark expressions, e.g. a reasoning section
    the output opens with) followed by the constrained text."""
    from llguidance import regex_to_lark
    if spec.grammar is not None:
        if prefix:
            raise ValueError("a Lark grammar is the whole output; it cannot follow a reasoning section (turn "
                             "thinking off: chat_template_kwargs {\"enable_thinking\": false})")
        return spec.grammar
    if spec.json is not None or spec.json_object:
        body = json_expression(spec.json if spec.json is not None else {"type": "object"})
    elif spec.regex is not None:
        body = f"/{regex_to_lark(spec.regex)}/"
    else:
        body = "(" + " | ".join(map(lark_literal, spec.choice)) + ")"
    return f"start: {prefix} {body}"


class Grammars:
    """The engine's grammar compiler and mask filler over one tokenizer (built on the first constrained request)."""

    def __init__(self, tokenizer, vocab_padded: int, eos_token_ids, cache_size: int = 64):
        import llguidance
        self.tokenizer = llguidance.LLTokenizer(tokenizer.hf.backend_tokenizer.to_str(), n_vocab=vocab_padded,
                                                eos_token=sorted(eos_token_ids))
        self.width = -(-vocab_padded // 32)
        self.executor = llguidance.LLExecutor()
        self._fresh: collections.OrderedDict = collections.OrderedDict()     # key -> matcher at the grammar's start
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def matcher(self, spec: StructuredOutputsParams | str):
        """A new matcher at the start of the grammar (a StructuredOutputsParams, or llguidance grammar text);
        ValueError for an invalid grammar. Compiled grammars are cached: a repeated one costs a copy."""
        from llguidance import LLMatcher
        key = spec if isinstance(spec, str) else spec.key()
        with self._lock:
            fresh = self._fresh.get(key)
            if fresh is not None:
                self._fresh.move_to_end(key)
                return fresh.deep_copy()
        grammar = LLMatcher.grammar_from_lark(spec if isinstance(spec, str) else lark_grammar(spec))
        fresh = LLMatcher(self.tokenizer, grammar, log_level=0)
        if fresh.is_error():
            raise ValueError(f"structured outputs: invalid grammar: {fresh.get_error()}")
        with self._lock:
            self._fresh[key] = fresh
            while len(self._fresh) > self._cache_size:
                self._fresh.popitem(last=False)
        return fresh.deep_copy()

    def bitmask(self, matchers: list) -> np.ndarray | None:
        """int32 [len(matchers), width]: each row's allowed tokens (all ones for rows whose matcher is None); None
        when no row is constrained."""
        rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        from llguidance.numpy import fill_next_token_bitmask_par
        mask = np.full((len(matchers), self.width), -1, np.int32)
        fill_next_token_bitmask_par(self.executor, rows, mask)
        return mask

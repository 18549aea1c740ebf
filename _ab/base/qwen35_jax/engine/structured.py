"""Structured outputs: grammars compiled by llguidance, applied as a token bitmask inside the compiled sampler.

Every constrained sequence holds an llguidance `LLMatcher`, its grammar's parser state, compiled for it alone: copies
of one matcher (`deep_copy`) share its lexer behind one lock, and the batch fill of copies ran row after row
(bench/RESULTS.md, structured outputs). Before a step samples such a row the engine fills the row's bitmask (one bit
per token of the padded vocabulary, int32 [rows, ceil(V / 32)], the layout llguidance writes) from the matcher, in
parallel over rows on llguidance's own threads; the bitmask is an input
of every compiled step (sampler.allowed_tokens), and unconstrained rows carry an all-ones mask (how decode overlaps
the mask with the model step: executor's docstring). After the step the sampled token advances the matcher.
llguidance rather than xgrammar: it needs no torch, and its mask cost and JSON-schema coverage were measured side
by side (bench/grammar_mask.py).

JSON is generated compact (", " and ": " separators, no free whitespace): with free whitespace a model can loop on
blank lines until max_tokens and never close the object.
"""
from __future__ import annotations

import json

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

    def __init__(self, tokenizer, vocab_padded: int, eos_token_ids):
        import llguidance
        self.tokenizer = llguidance.LLTokenizer(tokenizer.hf.backend_tokenizer.to_str(), n_vocab=vocab_padded,
                                                eos_token=sorted(eos_token_ids))
        self.width = -(-vocab_padded // 32)
        self.executor = llguidance.LLExecutor()

    def matcher(self, spec: StructuredOutputsParams | str):
        """A new matcher at the start of the grammar (a StructuredOutputsParams, or llguidance grammar text), compiled
        afresh (a millisecond or two for a JSON schema at 248k tokens; never a copy: see the module docstring);
        ValueError for an invalid grammar."""
        from llguidance import LLMatcher
        grammar = LLMatcher.grammar_from_lark(spec if isinstance(spec, str) else lark_grammar(spec))
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured outputs: invalid grammar: {matcher.get_error()}")
        return matcher

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

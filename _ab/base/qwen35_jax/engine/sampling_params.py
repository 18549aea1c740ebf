"""Per-request sampling parameters, named and validated as in vLLM."""
from __future__ import annotations

import dataclasses
import json


@dataclasses.dataclass
class StructuredOutputsParams:
    """A grammar the output must follow (vLLM's StructuredOutputsParams); exactly one field is set. json: a JSON
    schema (dict or JSON text); json_object: any JSON object; regex; choice: one of these strings; grammar: a Lark
    grammar (llguidance's dialect: `%json{...}` embeds a schema, `<[id]>` a token)."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self):
        set_ = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(f"structured outputs take exactly one of json, regex, choice, grammar, json_object; "
                             f"got {set_ or 'none'}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured outputs: json is not a JSON schema ({e})") from None
        checks = [(self.json is None or isinstance(self.json, dict), "json must be a JSON schema object"),
                  (self.regex is None or isinstance(self.regex, str) and self.regex, "regex must be a string"),
                  (self.grammar is None or isinstance(self.grammar, str) and self.grammar, "grammar must be a string"),
                  (self.choice is None or (isinstance(self.choice, list) and self.choice and
                                           all(isinstance(c, str) and c for c in self.choice)),
                   "choice must be a non-empty list of non-empty strings"),
                  (self.json_object in (None, True), "json_object must be true")]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"structured outputs: {message}")


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None         # number of top alternatives to return per token (0: the sampled token only)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (0: the prompt token only)
    min_tokens: int = 0
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None   # masks every sampled token to a grammar

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        checks = [
            (isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}"),
            (self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (isinstance(self.top_k, int) and 0 <= self.top_k < 2**31,        # the sampler holds it as int32
             f"top_k must be -1, 0 or a positive integer below 2**31, got {self.top_k!r}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (0 < self.repetition_penalty <= 2, f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
             f"logprobs must be an integer in [0, 20], got {self.logprobs!r}"),
            (self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and
                                              0 <= self.prompt_logprobs <= 20),
             f"prompt_logprobs must be an integer in [0, 20], got {self.prompt_logprobs!r}"),
            (isinstance(self.min_tokens, int) and self.min_tokens >= 0,
             f"min_tokens must be >= 0, got {self.min_tokens!r}"),
            (self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be a non-empty string or a list of them"),
            (self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
             "structured_outputs must be a StructuredOutputsParams"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

"""Results of generation, shaped like vLLM's `RequestOutput` / `CompletionOutput`."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int                            # 1 = the most likely token
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None        # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None    # the stop string or stop token id that ended it
    logprobs: list[dict[int, Logprob]] | None = None   # per generated token: sampled + top-N alternatives
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: dict | None = None          # monotonic timestamps: arrival, first scheduled, first and last token
    # SamplingParams.prompt_logprobs: per prompt token (None for the first) its logprob given the tokens before it
    # and the top alternatives; set once the whole prompt is done, None when not asked for
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0           # prompt tokens served from the prefix cache (of the first sequence)

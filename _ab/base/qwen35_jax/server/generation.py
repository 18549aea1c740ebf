"""The bridge from the engine thread to the server's event loop, and the split of reasoning from content.

`Generation` submits the engine requests behind one HTTP request and hands their latest cumulative outputs to the
event loop. The engine's outputs are cumulative, so a consumer that falls behind (a slow client, a busy loop)
skips intermediate ones instead of queueing them: one loop wake-up carries however many tokens arrived since the
last, and the event loop's work per token falls as load rises instead of piling up behind the engine.
"""
from __future__ import annotations

import asyncio
import functools
import uuid

from qwen35_jax.engine.outputs import RequestOutput
from qwen35_jax.engine.sampling_params import SamplingParams


class Generation:
    def __init__(self, engine, prompts: list, params: SamplingParams, prefix: str, matchers: list | None = None):
        """Submit every prompt (a {"prompt", "prompt_token_ids"} dict or ids); raises the engine's ValueError for a
        request that can never run, after aborting the ones already submitted. matchers: with structured outputs,
        each prompt's compiled grammars (engine.add_request's `matchers`)."""
        self.engine = engine
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()
        self._wake_pending = False
        self.latest: list[RequestOutput | None] = [None] * len(prompts)
        self.seen: list[RequestOutput | None] = [None] * len(prompts)
        self.request_ids: list[str] = []
        self.stopped: str | None = None          # why stop() ended it early
        try:
            for i, prompt in enumerate(prompts):
                rid = engine.add_request(prompt, params, functools.partial(self._put, i), f"{self.id}-{i}",
                                         matchers=matchers[i] if matchers else None)
                self.request_ids.append(rid)
        except BaseException:
            self.abort()
            raise

    def _put(self, i: int, out: RequestOutput):
        """Engine thread: publish the latest output; wake the loop unless a wake-up is already pending."""
        self.latest[i] = out
        if not self._wake_pending:
            self._wake_pending = True
            self._loop.call_soon_threadsafe(self._wake)

    def _wake(self):
        self._wake_pending = False
        self._event.set()

    @property
    def finished(self) -> bool:
        return all(o is not None and o.finished for o in self.seen)

    async def updates(self):
        """Yield [(prompt index, RequestOutput)] for the requests with new output, until all have finished (or
        stop() was called)."""
        while not self.finished and self.stopped is None:
            await self._event.wait()
            self._event.clear()
            changed = []
            for i, out in enumerate(self.latest):
                if out is not None and out is not self.seen[i]:
                    self.seen[i] = out
                    changed.append((i, out))
            if changed:
                yield changed

    def stop(self, reason: str):
        """End updates() now (the server is shutting down); `stopped` says why. Event loop only."""
        self.stopped = reason
        self._event.set()

    def abort(self):
        """Abort whatever has not finished (the client left, or the server is stopping); never blocks."""
        for i, rid in enumerate(self.request_ids):
            out = self.latest[i]
            if out is None or not out.finished:
                self.engine.abort(rid, wait=False)


class ReasoningSplitter:
    """Splits one sequence's cumulative text into (reasoning, content) at the think-end token.

    Qwen3.5's chat template may end the generation prompt inside `<think>\\n`; the output then starts in the
    reasoning block and holds only `</think>`. Otherwise the output is content, unless its first token opens a
    `<think>` block. The split is found by token id rather than by text, so it holds whether the tokenizer decodes
    the tags as text (released Qwen checkpoints) or drops them as special tokens.
    """

    def __init__(self, tokenizer, think_ids: tuple[int, int] | None, prompt_ids: list[int],
                 skip_special_tokens: bool):
        """think_ids: the (<think>, </think>) token ids (think_token_ids), None to turn the split off."""
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.start_id, self.end_id = think_ids or (None, None)
        self.active = think_ids is not None
        opened = reasoning_opened(think_ids, prompt_ids)
        self.begin = 0 if opened else None      # char offset where reasoning text starts
        self.search_from = 0                    # first token index that may be the think-end token
        self.boundary = None                    # char offset of the think-end token in the text
        self.decided = opened or not self.active

    def split(self, text: str, token_ids: list[int]) -> tuple[str | None, str]:
        """(reasoning or None when the output has no reasoning block, content) of the cumulative text."""
        if not self.decided and token_ids:
            self.decided = True
            if token_ids[0] == self.start_id:
                self.begin = len(self.tokenizer.decode(token_ids[:1], skip_special_tokens=self.skip))
                self.search_from = 1
        if self.begin is None:
            return None, text
        if self.boundary is None:
            try:
                k = token_ids.index(self.end_id, self.search_from)
            except ValueError:
                self.search_from = max(self.search_from, len(token_ids))    # each token is looked at once
                return text[self.begin:], ""
            self.boundary = max(self.begin, len(self.tokenizer.decode(token_ids[:k], skip_special_tokens=self.skip)))
        rest = text[self.boundary:]
        if rest.startswith("</think>"):
            rest = rest[len("</think>"):]
        return text[self.begin:self.boundary], rest.lstrip("\n")


def reasoning_opened(think_ids: tuple[int, int] | None, prompt_ids: list[int]) -> bool:
    """Does the prompt end inside a reasoning block (its last `<think>` after its last `</think>`)?"""
    if think_ids is None:
        return False
    last = lambda tok: max((k for k, t in enumerate(prompt_ids) if t == tok), default=-1)
    return last(think_ids[0]) > last(think_ids[1])


@functools.lru_cache(maxsize=8)
def think_token_ids(tokenizer) -> tuple[int, int] | None:
    """The ids of `<think>` and `</think>` when the tokenizer has both as single tokens (Qwen3.5 does)."""
    vocab = tokenizer.hf.get_vocab()
    ids = vocab.get("<think>"), vocab.get("</think>")
    return None if None in ids else ids

"""Continuous batching: FCFS admission bounded by slots and KV pages, chunked prefill under a token budget.

The scheduler is pure host bookkeeping. Each step it returns the decode rows (every running request whose prompt
is done; their next input token is already on the device) and the prefill chunks that fit the remaining budget.
Admission reserves a GDN state slot and the KV pages for prompt + max_tokens at once, so a running request never
needs to be preempted; a prompt that could never fit is rejected when it is submitted.

With prefix caching (engine.prefix_cache) admission first looks the prompt up: a request resuming from a snapshot
shares the cached pages of its prefix, starts its prefill there (the step plan's `restores` copy the snapshot into
its slot first) and ends a chunk at its branch point; chunk ends before a prompt's end and finished requests leave
snapshots (the plan's `saves` and `finished_saves`).
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import time
from typing import Any

from qwen35_jax.engine.prefix_cache import Copy, Hit, PrefixCache, Snapshot
from qwen35_jax.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    """One sequence being generated (a request with n > 1 is n of these, sharing a parent id)."""
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int                                   # uint32 key of this sequence's randomness
    max_tokens: int                             # already capped by max_model_len
    index: int = 0                              # position among the parent's n outputs
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    status: Status = Status.WAITING
    replica: int = 0                            # data-parallel replica holding its state
    slot: int = 0                               # slot index within the replica (0 = null)
    pages: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0                       # tokens whose state/KV is computed or in flight
    num_sampled: int = 0                        # sampling events dispatched (tokens that will come back)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    matcher: Any = None                         # structured outputs: the grammar's llguidance matcher
    num_cached: int = 0                         # prompt tokens served from the prefix cache
    restore: Snapshot | None = None             # the snapshot to copy into its slot before its first chunk
    save_at: int | None = None                  # its branch point: a chunk ends there and leaves a snapshot
    digests: list = dataclasses.field(default_factory=list)     # its pages' chained digests (prefix_cache.digests)
    nodes: list = dataclasses.field(default_factory=list)       # its pages' cache nodes (prefix_cache.snapshot)
    steps_in_flight: int = 0                    # speculative decoding: its steps dispatched and not yet read back

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def prefill_done(self) -> bool:
        return self.num_computed >= self.prompt_len

    @property
    def num_generated(self) -> int:
        """Sampling steps dispatched so far: keys this sequence's next random draw."""
        return self.num_sampled

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclasses.dataclass
class Chunk:
    request: Request
    start: int          # first prompt position in this chunk
    length: int

    @property
    def completes_prompt(self) -> bool:
        return self.start + self.length >= self.request.prompt_len


@dataclasses.dataclass
class StepPlan:
    decode: list[Request]
    prefill: list[Chunk]
    prefill_shape: tuple[int, int] | None      # (rows per replica, tokens per row) bucket of the prefill call
    # the prefix cache's device copies as (replica, Copy): restores (snapshot -> slot) before the prefill, saves
    # (slot -> snapshot, at chunk ends) after it
    restores: list[tuple[int, Copy]] = dataclasses.field(default_factory=list)
    saves: list[tuple[int, Copy]] = dataclasses.field(default_factory=list)
    # the snapshots of requests finished since the last plan (slot -> snapshot), dispatched before anything else:
    # their slots may be reused in this plan
    finished_saves: list[tuple[int, Copy]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Pool:
    """One data-parallel replica's free slots and its page allocator / prefix cache (index 0 of each is null)."""
    free_slots: list[int]
    cache: PrefixCache
    running: int = 0


def next_bucket(x: int, buckets) -> int:
    for b in buckets:
        if b >= x:
            return b
    raise ValueError(f"{x} exceeds the largest bucket {buckets[-1]}")


class Scheduler:
    def __init__(self, *, num_slots: int, num_pages: int, page_size: int, max_model_len: int,
                 max_num_batched_tokens: int, decode_buckets, prefill_buckets, dp: int = 1, num_snapshots: int = 0,
                 lookahead: int = 0, decode_prefill_budget: int | None = None, mixed=()):
        """num_slots, num_pages and num_snapshots (GDN state snapshots of the prefix cache; 0: no prefix caching)
        are per data-parallel replica. lookahead: positions past its last token that a request's step may write
        (speculative decoding), given pages with the rest. decode_prefill_budget: the most prompt tokens a step
        with decode rows may prefill (None: what max_num_batched_tokens leaves). mixed: the mixed steps' prefill
        shapes, (1, t) up to the budget: a step with decode rows prefills one row per replica in the smallest that
        holds its chunk (up to the budget), the chunk and the decode rows then running as one forward
        (Executor.run_mixed)."""
        self.lookahead, self.decode_prefill_budget = lookahead, decode_prefill_budget
        self.mixed = list(mixed)
        self.num_slots, self.page_size, self.max_model_len = num_slots, page_size, max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.decode_buckets = sorted(decode_buckets)
        self.prefill_buckets = sorted(prefill_buckets, key=lambda nt: (nt[0] * nt[1], nt[1]))
        self.snapshot_stride = max(t for _, t in self.prefill_buckets)   # chunk-end snapshots: see schedule
        self.pools = [Pool(list(range(num_slots, 0, -1)),
                           PrefixCache(page_size, list(range(num_pages - 1, 0, -1)), num_snapshots))
                      for _ in range(dp)]
        self.num_pages = num_pages
        self.prefix_queries = self.prefix_hits = 0      # prompt tokens looked up / found (vLLM's counters)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.retired: list[tuple[Request, bool]] = []   # finished, their slots and pages not yet returned (release)
        self.finished_saves: list[tuple[int, Copy]] = []

    # -- capacity ------------------------------------------------------------------------------------------------
    def pages_needed(self, prompt_len: int, max_tokens: int) -> int:
        return -(-(prompt_len + max_tokens + self.lookahead) // self.page_size)

    def check_fits(self, prompt_len: int, max_tokens: int):
        """Raise if this request could never be admitted, however empty the engine is."""
        if prompt_len < 1:
            raise ValueError("prompt is empty")
        if prompt_len + 1 > self.max_model_len:
            raise ValueError(f"prompt has {prompt_len} tokens; with at least one generated token that exceeds "
                             f"max_model_len={self.max_model_len}")
        need = self.pages_needed(prompt_len, max_tokens)
        if need > self.num_pages - 1:
            raise ValueError(f"request needs {need} KV pages ({prompt_len} prompt + {max_tokens} max tokens) but "
                             f"the pool has {self.num_pages - 1}")

    @property
    def free_slots(self) -> list[int]:
        return [s for p in self.pools for s in p.free_slots]

    @property
    def available_pages(self) -> int:
        """KV pages a request can be given: free ones and those only cached snapshots hold (evicted on demand)."""
        return sum(p.cache.available() for p in self.pools)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV pages held by requests (pages only cached snapshots hold count as free)."""
        return 1.0 - self.available_pages / max(1, len(self.pools) * (self.num_pages - 1))

    @property
    def slot_usage(self) -> float:
        return 1.0 - len(self.free_slots) / (len(self.pools) * self.num_slots)

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def add(self, req: Request):
        self.check_fits(req.prompt_len, req.max_tokens)
        self.waiting.append(req)

    def finish(self, req: Request, exact: bool = True):
        """End a finished or aborted request: no step schedules it again. Its slot and pages go back in `release`
        (the engine calls it once the request's last output is out, so the prefix cache's bookkeeping does not
        delay it; `schedule` calls it too). With prefix caching its state is then kept as a snapshot where every
        token fed so far is known (decode_steps > 1 may have fed tokens past a stop) and exact (False: a step in
        flight may still feed it more)."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self.retired.append((req, exact))
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        req.status = Status.FINISHED

    def release(self):
        """Return the finished requests' slots and pages; their snapshots' device copies collect in
        `finished_saves` (the next plan's, dispatched before a slot is reused)."""
        for req, exact in self.retired:
            pool = self.pools[req.replica]
            if req.restore is not None:          # admitted, never dispatched
                pool.cache.restored(req.restore)
                req.restore = None
            elif exact and req.num_computed <= req.prompt_len + len(req.output_ids):
                copy = pool.cache.snapshot(req.slot, req.prompt_ids + req.output_ids, req.num_computed, req.pages,
                                           req.digests, req.nodes)
                if copy:
                    self.finished_saves.append((req.replica, copy))
            pool.free_slots.append(req.slot)
            pool.cache.release(req.pages)
            pool.running -= 1
            req.slot, req.pages = 0, []
        self.retired.clear()

    def take_finished_saves(self) -> list[tuple[int, Copy]]:
        """The released requests' snapshot copies not yet handed out (to a plan, or to an idle engine)."""
        saves, self.finished_saves = self.finished_saves, []
        return saves

    def reset_prefix_cache(self) -> bool:
        """Drop every cached snapshot (and the pages only they held); False if a restore was still pending."""
        self.release()
        return all([p.cache.reset() for p in self.pools])

    def _admit(self) -> Request | None:
        """FCFS: the oldest waiting request goes to the replica with the longest cached prefix for it, then the
        least loaded, among those that can hold it; or nothing moves."""
        req = self.waiting[0]
        need = self.pages_needed(req.prompt_len, req.max_tokens)
        look = req.params.prompt_logprobs is None        # prompt logprobs need every position's logits
        tried = []
        for i, p in enumerate(self.pools):
            if p.free_slots and p.running < self.decode_buckets[-1]:
                hit = p.cache.lookup(req.prompt_ids, req.prompt_len - 1, req.digests) if look else Hit(None, [])
                tried.append((-hit.length, p.running, i, hit))
        for _, _, i, hit in sorted(tried, key=lambda x: x[:3]):
            pool, snap = self.pools[i], hit.snapshot
            shared = snap.pages[:hit.length // self.page_size] if snap else []
            pool.cache.share(shared)                    # taken first: the allocation may evict other snapshots
            if snap:
                pool.cache.use(snap)
            own = pool.cache.allocate(need - len(shared))
            if own is None:
                pool.cache.release(shared)
                if snap:
                    pool.cache.restored(snap)
                continue
            self.waiting.popleft()
            req.replica, req.slot = i, pool.free_slots.pop()
            req.pages = shared + own
            req.num_computed = req.num_cached = hit.length
            req.restore = snap
            branch = len(hit.chain) * self.page_size
            req.save_at = branch if branch > hit.length else None
            if look:
                self.prefix_queries += req.prompt_len
                self.prefix_hits += hit.length
            pool.running += 1
            req.status = Status.RUNNING
            req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            return req
        return None

    # -- one step ------------------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        self.release()
        decode = [r for r in self.running if r.prefill_done and r.num_sampled < r.max_tokens]
        per_replica = collections.Counter(r.replica for r in decode)
        budget = self.max_num_batched_tokens - max(per_replica.values(), default=0)
        buckets = self.prefill_buckets
        if decode and self.mixed:       # the decode rows ride in the same forward: the whole budget is the chunk's
            buckets, budget = self.mixed, self.decode_prefill_budget
        elif decode and self.decode_prefill_budget is not None:
            budget = min(budget, self.decode_prefill_budget)
        candidates = [r for r in self.running if not r.prefill_done]
        chunks: list[Chunk] = []
        shape = None
        while True:
            if not candidates:
                if not self.waiting or self._admit() is None:
                    break
                candidates.append(self.running[-1])
            req = candidates[0]
            remaining = self._segment_end(req) - req.num_computed
            trial = [c.request for c in chunks] + [req]
            fit = self._fit(trial, budget, buckets)
            if fit is None:
                break
            shape = fit
            candidates.pop(0)
            chunks.append(Chunk(req, req.num_computed, 0))
            if remaining > shape[1]:   # this row is chunked: nothing after it can join a larger bucket usefully
                break
        plan = StepPlan(decode=decode, prefill=chunks, prefill_shape=shape, finished_saves=self.take_finished_saves())
        for c in chunks:
            r = c.request
            c.length = min(self._segment_end(r) - c.start, shape[1])
            if r.restore is not None:     # its first chunk: the copy is dispatched before anything below writes
                snap, cache = r.restore, self.pools[r.replica].cache
                own = r.pages[len(snap.pages)] if snap.page else 0     # the page holding position num_cached
                plan.restores.append((r.replica, Copy(r.slot, snap.entry, snap.page, own,
                                                      r.prompt_ids[:r.num_cached])))
                cache.restored(snap)
                r.restore = None
            end = c.start + c.length
            # a chunk end inside the prompt leaves a snapshot at its branch point (after every admission) and
            # where it passes a multiple of the stride: every chunk of a prompt prefilled alone, but not every
            # 32-token chunk of one that rides with decode rows (each snapshot pins its whole prefix)
            stride = self.snapshot_stride
            if end < r.prompt_len and (end == r.save_at or end // stride > c.start // stride):
                if end == r.save_at:
                    r.save_at = None
                copy = self.pools[r.replica].cache.snapshot(r.slot, r.prompt_ids, end, r.pages, r.digests, r.nodes)
                if copy:
                    plan.saves.append((r.replica, copy))
        return plan

    @staticmethod
    def _segment_end(r: Request) -> int:
        """Where the request's next chunk must end at the latest: its branch point, else its prompt's end."""
        return r.save_at if r.save_at is not None and r.save_at > r.num_computed else r.prompt_len

    def _fit(self, reqs: list[Request], budget: int, buckets):
        """Smallest prefill bucket (rows per replica, tokens) holding these rows' next chunks within the budget
        (per replica); the tokens dimension may be smaller than a row's remaining prompt (it is then chunked)."""
        remaining = [self._segment_end(r) - r.num_computed for r in reqs]
        per_replica = max(collections.Counter(r.replica for r in reqs).values())
        best = None
        for rows, t in buckets:
            if rows < per_replica or rows * t > max(budget, 0):
                continue
            if len(reqs) > 1 and any(rem > t for rem in remaining):
                continue       # several rows per call only when they all finish their prompt in it
            score = (sum(min(rem, t) for rem in remaining), -rows * t)
            if best is None or score > best[0]:
                best = (score, (rows, t))
        return None if best is None else best[1]

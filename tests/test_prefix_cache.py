"""Prefix caching: the host bookkeeping (pages, snapshots, eviction) and the engine's exactness against cold runs
(fp32 on CPU, tp 1 and 2): hits on a page boundary, between boundaries, on a whole prompt, for concurrent requests
sharing a prefix, after eviction and slot reuse, with penalties and seeds."""
import functools

import numpy as np
import pytest

from conftest import engine_args, fixture_dir
from qwen35_jax.engine import prefix_cache as pc
from qwen35_jax.engine.prefix_cache import PrefixCache
from qwen35_jax.engine.sampling_params import SamplingParams
from qwen35_jax.engine.scheduler import Request, Scheduler
from qwen35_jax.llm import LLM

PS = 4


def cache(pages=16, snapshots=4):
    return PrefixCache(PS, list(range(pages - 1, 0, -1)), snapshots)


def test_lookup_finds_the_deepest_snapshot_within_the_limit():
    c = cache()
    toks = list(range(100, 114))                   # 14 tokens: 3 full pages + 2
    pages = c.allocate(4)
    save = c.snapshot(slot=3, tokens=toks, length=14, pages=pages)
    assert (save.slot, save.src_page) == (3, pages[3]) and save.dst_page not in pages and save.entry
    assert c.snapshot(3, toks, 14, pages) is None                  # already cached
    assert c.snapshot(3, toks, 8, pages).src_page == 0             # page-aligned: no partial page
    hit = c.lookup(toks + [1, 2], limit=15)
    assert hit.length == 14 and hit.chain == pages[:3]
    assert c.lookup(toks, limit=13).length == 8                    # the longer one is past the limit
    assert c.lookup(toks[:13] + [0], limit=13).length == 8         # diverges inside the partial page
    memo = []
    miss = c.lookup([7] + toks[1:], limit=15, memo=memo)
    assert miss.snapshot is None and miss.chain == [] and len(memo) == 1   # a miss hashes only the first page
    branch = c.lookup(toks[:12] + [0, 0, 0], limit=14)             # pages match beyond the best snapshot
    assert branch.length == 8 and len(branch.chain) == 3


def test_pages_are_refcounted_and_freed_with_their_last_holder():
    c = cache(pages=10)
    toks = list(range(9))
    req = c.allocate(3)
    c.snapshot(1, toks, 9, req)                    # pins pages 0-1 of req, copies the partial into a new page
    assert len(c.free_pages) == 9 - 4
    c.release(req)                                 # the request ends: its third page is free, the chain is kept
    assert len(c.free_pages) == 9 - 3 and c.available() == 9
    other = c.lookup(toks + [5], 9)
    c.share(other.snapshot.pages)
    assert c.reset()                               # snapshot gone; the sharing request still holds its pages
    assert len(c.free_pages) == 9 - 2 and c.lookup(toks, 9).snapshot is None
    c.release(other.snapshot.pages)
    assert len(c.free_pages) == 9 and not c.refs.any() and not c.nodes


def test_eviction_is_lru_and_spares_pending_restores():
    c = cache(pages=32, snapshots=2)
    a, b, d = ([k] * 8 for k in (1, 2, 3))
    for toks in (a, b):
        p = c.allocate(2)
        c.snapshot(1, toks, 8, p)
        c.release(p)
    c.use(c.lookup(a + [0], 8).snapshot)           # a is pending a restore: b is the one to go
    p = c.allocate(2)
    assert c.snapshot(1, d, 8, p) is not None
    assert c.lookup(b + [0], 8).snapshot is None and c.lookup(a + [0], 8).snapshot is not None
    c.restored(c.lookup(a + [0], 8).snapshot)
    c.release(p)
    assert c.allocate(32 - 1) is not None          # evicts every snapshot to free the pages only they held
    assert c.num_snapshots == 0


def test_a_digest_collision_never_hits(monkeypatch):
    monkeypatch.setattr(pc, "page_digest", lambda parent, tokens: bytes([len(parent)]))  # one per depth
    c = cache()
    p = c.allocate(2)
    c.snapshot(1, [1] * 8, 8, p)
    assert c.lookup([2] * 8 + [0], 8).snapshot is None             # same digest, other tokens
    assert c.snapshot(1, [2] * 8, 8, c.allocate(2)) is None         # and nothing is cached over it
    assert c.lookup([1] * 8 + [0], 8).length == 8


def test_a_requests_node_memo_walks_only_new_pages():
    """snapshot's `nodes` memo: later snapshots of a request start after the pages an earlier one registered, and
    leave what a walk from the root leaves; a page whose node is another request's (the same tokens computed
    twice) stops the memo, so that node's eviction cannot leave a stale one in it."""
    c = cache(pages=40, snapshots=8)
    toks = list(range(200, 240))
    other = c.allocate(3)
    c.snapshot(1, toks, 8, other)                  # pages 0-1 of toks are the other request's nodes
    c.release(other)
    mine, digests, nodes = c.allocate(10), [], []
    c.snapshot(2, toks, 6, mine, digests, nodes)
    assert nodes == []                            # page 0's node holds the other request's page
    c.reset()                                     # drops that snapshot and its pages' nodes
    assert not c.nodes
    c.snapshot(2, toks, 14, mine, digests, nodes)
    assert [n.page for n in nodes] == mine[:3]    # registered anew, on this request's pages
    walked = []
    node = c.nodes[digests[2]]
    while node.parent is not None:
        walked.append(node)
        node = node.parent
    assert walked[::-1] == nodes

    class Gets(dict):
        def get(self, key, default=None):
            self.calls = getattr(self, "calls", 0) + 1
            return super().get(key, default)

    c.nodes = Gets(c.nodes)
    c.snapshot(2, toks, 30, mine, digests, nodes)
    assert c.nodes.calls == 4                     # pages 3-6: those after the memo's
    snap = max(c.snapshots, key=lambda s: s.length)
    assert snap.length == 30 and snap.pages == mine[:7] and [n.page for n in nodes] == mine[:7]
    fresh = cache(pages=40, snapshots=8)
    fresh.snapshot(2, toks, 30, fresh.allocate(10))
    shape = lambda cc: sorted((n.depth, n.tokens, n.parent.depth) for n in cc.nodes.values())
    assert shape(fresh) == shape(c)


def test_chunk_end_snapshots_follow_the_stride():
    """A prompt prefilled alone leaves a snapshot at every chunk end; one whose chunks ride with decode rows (mixed
    steps of 8 tokens here) only where it passes a multiple of the largest prefill chunk (32), and at its branch
    point. Each snapshot pins its whole prefix, so one per mixed chunk made a long prompt's steps host-bound."""
    s = Scheduler(num_slots=4, num_pages=160, page_size=PS, max_model_len=200, max_num_batched_tokens=32,
                  decode_buckets=[1, 2, 4], prefill_buckets=[(1, 8), (1, 16), (1, 32)], num_snapshots=32,
                  decode_prefill_budget=8, mixed=[(1, 8)])
    cache = s.pools[0].cache
    sp = SamplingParams(max_tokens=100, ignore_eos=True)

    def prefill(prompt):
        """Schedule until the prompt's prefill is done; the positions of the snapshots its chunks left."""
        req = Request(str(len(s.running)), prompt, sp, 0, 100)
        s.add(req)
        before = set(cache.snapshots)
        while not req.prefill_done:
            plan = s.schedule()
            for c in plan.prefill:
                c.request.num_computed += c.length
            for r in plan.decode:
                r.num_computed += 1
        return req, sorted(snap.length for snap in cache.snapshots if snap not in before)

    alone, saved = prefill(tokens(100, seed=1))
    assert saved == [32, 64, 96]                 # chunks of 32: every chunk end
    mixed, saved = prefill(tokens(100, seed=2))  # beside the first one's decode row: chunks of 8
    assert saved == [32, 64, 96]
    branch, saved = prefill(alone.prompt_ids[:42] + tokens(30, seed=3))   # resumes at 32, cached pages to 40
    assert branch.num_cached == 32 and saved == [40, 64]


def test_prefix_bits():
    bits = pc.prefix_bits([0, 5, 33, 33], 3).view(np.uint32)
    assert bits.tolist() == [1 | 1 << 5, 1 << 1, 0]


# -- the engine ---------------------------------------------------------------------------------------------------
CASE = "text_untied_r1_g6"
SP = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5)


@functools.lru_cache(maxsize=2)
def llm(tp):
    return LLM(fixture_dir(CASE), tensor_parallel_size=tp, skip_tokenizer_init=True,
               **engine_args(precompile=False, num_state_snapshots=6))


def run(model, prompts, sp=SP):
    outs = model.generate(prompts, sp)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs],
             o.num_cached_tokens) for o in outs]


def cold(model, prompts, sp=SP):
    model.engine.reset_prefix_cache()
    out = run(model, prompts, sp)
    model.engine.reset_prefix_cache()
    return out


def same(hit, ref):
    """Same tokens, and at each position the same top logprobs within 1e-5 (fp32)."""
    assert hit[0] == ref[0]
    for h, r in zip(hit[1], ref[1]):
        assert h.keys() == r.keys()
        np.testing.assert_allclose([h[t] for t in r], list(r.values()), atol=1e-5, rtol=0)


def tokens(n, seed):
    return np.random.default_rng(seed).integers(2, 250, size=n).tolist()


@pytest.mark.parametrize("tp", [1, 2])
def test_hits_equal_cold_runs(tp):
    model = llm(tp)
    base = tokens(70, seed=tp)                   # chunks of 64 (max_num_batched_tokens): a snapshot at 64
    ref = cold(model, [base])[0]
    first = run(model, [base])[0]                # cold again (reset), leaves snapshots at 64 and at its end
    assert first[2] == 0
    same(first, ref)
    whole = run(model, [base])[0]                # whole-prompt hit: the chunk-end snapshot, 6 tokens recomputed
    assert whole[2] == 64
    same(whole, ref)
    turn = base + first[0] + tokens(5, seed=9)   # the next turn: resumes where the last one ended (not aligned)
    hit = run(model, [turn])[0]
    assert hit[2] == 70 + 6 - 1
    same(hit, cold(model, [turn])[0])


@pytest.mark.parametrize("tp", [1, 2])
def test_branch_points_and_concurrent_requests(tp):
    model = llm(tp)
    model.engine.reset_prefix_cache()
    shared = tokens(37, seed=20)                 # 2 full pages of 16 and 5 tokens
    a, b = shared + tokens(9, seed=21), shared + tokens(11, seed=22)
    run(model, [a])
    first_b = run(model, [b])[0]                 # no snapshot inside the shared part: ends a chunk at 32
    assert first_b[2] == 0
    many = [shared + tokens(k, seed=30 + k) for k in (3, 8, 12, 20)]
    hits = run(model, many)                      # together, all resuming from the branch point
    assert [h[2] for h in hits] == [32] * 4
    for h, ref in zip(hits, cold(model, many)):
        same(h, ref)


@pytest.mark.parametrize("tp", [1, 2])
def test_eviction_and_slot_reuse(tp):
    model = llm(tp)
    model.engine.reset_prefix_cache()
    prompts = [tokens(20 + k, seed=40 + k) for k in range(8)]      # 8 finish snapshots into a pool of 6: the
    outs = run(model, prompts)                                     # last two reuse the first two's entries
    follow = [p + o[0] + [7] for p, o in zip(prompts, outs)]
    late = run(model, follow[2:])
    assert [h[2] for h in late] == [len(p) + 5 for p in prompts[2:]]
    assert [h[2] for h in run(model, follow[:2])] == [0, 0]       # evicted
    for h, ref in zip(late, cold(model, follow[2:])):
        same(h, ref)


def test_penalties_and_seeds_see_the_cached_prompt():
    model = llm(1)
    base = tokens(50, seed=50)
    sp = SamplingParams(max_tokens=8, temperature=0.8, seed=7, repetition_penalty=1.8, presence_penalty=0.5,
                        ignore_eos=True, logprobs=5)
    first = run(model, [base], sp)[0]
    turn = base + first[0] + [3]                 # the answer's tokens are prompt tokens now (repetition penalty)
    ref = cold(model, [turn], sp)[0]
    run(model, [base], sp)
    hit = run(model, [turn], sp)[0]
    assert hit[2] == 50 + 8 - 1
    same(hit, ref)


def test_prompt_logprobs_skip_the_cache():
    model = llm(1)
    base = tokens(30, seed=60)
    turn = base + run(model, [base])[0][0]
    out = model.generate([turn + [4]], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))[0]
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == 37
    queries, hits = model.engine.scheduler.prefix_queries, model.engine.scheduler.prefix_hits
    assert run(model, [turn + [5]])[0][2] == 35
    assert model.engine.scheduler.prefix_queries == queries + 37 and model.engine.scheduler.prefix_hits == hits + 35


def test_prefix_caching_off():
    model = LLM(fixture_dir(CASE), skip_tokenizer_init=True,
                **engine_args(precompile=False, enable_prefix_caching=False))
    base = tokens(30, seed=70)
    run(model, [base])
    assert run(model, [base + [1]])[0][2] == 0 and model.engine.executor.snaps is None

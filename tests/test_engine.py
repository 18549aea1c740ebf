"""Continuous-batching engine on CPU: batch invariance, seeded sampling, slot reuse, aborts, no compiles while
serving, chunked prefill."""
import contextlib
import functools
import gc
import os
import threading
import time
import weakref

import jax
import numpy as np
import pytest

from conftest import engine_args, fixture_dir, reference, settled
from qwen35_jax.model.backends import KernelConfig
from qwen35_jax.llm import LLM
from qwen35_jax.engine.sampling_params import SamplingParams
from qwen35_jax.engine.sampler import host_batch
from qwen35_jax.engine.scheduler import Status

CASE = "text_untied_r1_g6"   # untied head: a spread-out distribution for the sampling tests


@functools.lru_cache(maxsize=2)
def llm(tp):
    """tp=1 is precompiled (test_no_compilation_while_serving runs on it); tp=2 compiles the buckets it uses: the
    precompile sweep under tp=2 is run by the dp x tp and warm-start tests below (a decode executable per sampler
    mode and bucket made a full tp=2 sweep here the suite's slowest step)."""
    return LLM(fixture_dir(CASE), tensor_parallel_size=tp, skip_tokenizer_init=True,
               **engine_args(precompile=tp == 1))


def prompts(n, seed=0, lo=3, hi=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 250, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("tp", [1, 2])
def test_batch_invariance_greedy(tp):
    model = llm(tp)
    ps = prompts(8, seed=tp)
    alone = [model.generate([p], GREEDY)[0].outputs[0].token_ids for p in ps]
    together = [o.outputs[0].token_ids for o in model.generate(ps, GREEDY)]
    assert alone == together
    ref = reference(CASE)
    assert model.generate([ref["prompt_7"].tolist()], SamplingParams(max_tokens=16, temperature=0,
                                                                     ignore_eos=True))[0].outputs[0].token_ids \
        == ref["greedy_7"].tolist()


@pytest.mark.parametrize("tp", [1, 2])
def test_seeded_sampling_alone_and_mixed(tp):
    model = llm(tp)
    p = prompts(1, seed=11)[0]
    sp = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = model.generate([p], sp)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=14, temperature=0.7, ignore_eos=True), GREEDY,
              SamplingParams(max_tokens=6, temperature=1.3, min_p=0.05, ignore_eos=True)]
    mixed = model.generate(prompts(3, seed=12) + [p], others + [sp])
    assert mixed[-1].outputs[0].token_ids == alone
    again = model.generate(prompts(2, seed=13) + [p], [GREEDY, GREEDY, sp])
    assert again[-1].outputs[0].token_ids == alone
    unseeded = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    a, b = (model.generate([p], unseeded)[0].outputs[0].token_ids for _ in range(2))
    assert a != b        # unseeded requests are decorrelated


def test_recycled_slot_matches_fresh_engine():
    model = llm(1)
    model.generate(prompts(8, seed=21, lo=30, hi=60), SamplingParams(max_tokens=20, temperature=1.0,
                                                                      ignore_eos=True))
    p = prompts(1, seed=22)[0]
    used = model.generate([p], GREEDY)[0].outputs[0].token_ids
    fresh = LLM(fixture_dir(CASE), skip_tokenizer_init=True, **engine_args(precompile=False))
    assert used == fresh.generate([p], GREEDY)[0].outputs[0].token_ids
    # A dropped LLM frees its engine: weights, state and compiled executables (notebooks rebuild engines).
    executor = weakref.ref(fresh.engine.executor)
    del fresh
    gc.collect()
    assert executor() is None


def test_abort_frees_slot_and_pages_at_once():
    model = llm(1)
    eng = model.engine
    sched = settled(eng)
    free_slots, free_pages = len(sched.free_slots), sched.available_pages
    started = threading.Event()
    rid = eng.add_request(prompts(1, seed=31)[0], SamplingParams(max_tokens=200, ignore_eos=True),
                          lambda out: started.set())
    assert started.wait(60)
    assert len(sched.free_slots) == free_slots - 1
    eng.abort(rid)
    assert len(sched.free_slots) == free_slots and sched.available_pages == free_pages


def test_last_output_goes_out_before_the_slot_is_returned():
    """A finishing request's bookkeeping (slot, pages, its prefix-cache snapshot) waits until its last output is
    delivered, and is done before the engine's next step."""
    model = llm(1)
    eng = model.engine
    sched = settled(eng)
    free_slots, free_pages = len(sched.free_slots), sched.available_pages
    held = []

    def callback(out):
        if out.finished:
            held.append((len(sched.free_slots), out.outputs[0].finish_reason))

    eng.add_request(prompts(1, seed=41)[0], SamplingParams(max_tokens=1, ignore_eos=True), callback)
    for _ in range(600):
        if held and not sched.retired:
            break
        threading.Event().wait(0.05)
    assert held == [(free_slots - 1, "length")]
    assert len(sched.free_slots) == free_slots and sched.available_pages == free_pages and not sched.retired
    # the next request runs as usual in the returned slot
    assert len(model.generate([prompts(1, seed=42)[0]], GREEDY)[0].outputs[0].token_ids) == 12


def test_state_of_an_idle_engine_stays_valid():
    """LLM.state: the decoding state after the finished requests' bookkeeping, whose prefix snapshots are copies
    that replace (donate) the state arrays a moment after a generate returns, so engine.executor.state read then is
    deleted under the reader; LLM.state's arrays stay valid while no request runs. Refused while one is in
    flight."""
    model = llm(1)
    eng = model.engine
    settled(eng)
    model.generate([prompts(1, seed=51, lo=50, hi=51)[0]], GREEDY)      # whole pages: a prefix snapshot to save
    racy = eng.executor.state
    deadline = time.monotonic() + 30
    while not any(x.is_deleted() for x in jax.tree.leaves(racy)):     # what this guards against
        assert time.monotonic() < deadline, "the finished request's snapshot was never saved"
        threading.Event().wait(0.01)
    model.generate([prompts(1, seed=52, lo=50, hi=51)[0]], GREEDY)
    state = model.state()
    assert not eng.scheduler.retired
    threading.Event().wait(0.2)
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))
    assert [x.shape for x in state.recurrent] == [x.shape for x in eng.executor.state.recurrent]
    rid = eng.add_request(prompts(1, seed=53)[0], SamplingParams(max_tokens=200, ignore_eos=True), lambda out: None)
    with pytest.raises(RuntimeError, match="in flight"):
        model.state()
    eng.abort(rid)


def test_bad_requests_get_clear_errors():
    model = llm(1)
    with pytest.raises(ValueError, match="max_model_len=256"):
        model.generate([[5] * 300], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.generate([[5, 9999]], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        model.generate([[]], GREEDY)
    for ids in ([5, 6.5], [[5, 6]], ["5"]):
        with pytest.raises(ValueError, match="flat sequence of integers"):
            model.generate([ids], GREEDY)
    assert model.generate([[5, 6]], GREEDY)[0].outputs[0].finish_reason == "length"   # still serving
    assert model.generate([np.array([5, 6], np.int64)], GREEDY)[0].prompt_token_ids == [5, 6]


def test_max_model_len_beyond_the_context_window_is_refused():
    from qwen35_jax.engine.engine import EngineArgs, build_engine
    with pytest.raises(ValueError, match="max_position_embeddings=4096"):
        build_engine(fixture_dir(CASE), EngineArgs(skip_tokenizer_init=True, **engine_args(max_model_len=4097)))


def test_no_compilation_while_serving():
    model = llm(1)
    events = []
    listener = lambda name, secs, **kw: events.append(name) if "compile" in name or "trace" in name else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        rng = np.random.default_rng(5)
        ps = prompts(50, seed=41, lo=1, hi=150)
        params = [SamplingParams(max_tokens=int(rng.integers(1, 30)), temperature=float(rng.choice([0, 0.8])),
                                 top_k=int(rng.choice([0, 20])),
                                 logprobs=int(rng.choice([0, 3])) if i % 5 == 0 else None,
                                 presence_penalty=0.5 if i % 7 == 0 else 0.0, ignore_eos=True, n=1 + (i % 11 == 0))
                  for i in range(50)]
        outs = model.generate(ps, params)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert all(o.finished for o in outs)
    assert [len(o.outputs) for o in outs] == [sp.n for sp in params]
    assert all(len(c.token_ids) == sp.max_tokens for o, sp in zip(outs, params) for c in o.outputs)
    assert events == []


@pytest.mark.parametrize("tp", [1, 2])
def test_chunked_prefill_equals_one_shot(tp):
    model = llm(tp)
    ref = reference(CASE)
    ids = ref["prompt_70"].tolist()                  # 70 tokens > 64-token budget: prefilled in chunks
    out = model.generate([ids], SamplingParams(max_tokens=1, temperature=0, logprobs=20))[0].outputs[0]
    one_shot = model.logits(ids)[-1]
    lp = one_shot - one_shot.max() - np.log(np.exp(one_shot - one_shot.max()).sum())
    got = out.logprobs[0]
    assert out.token_ids[0] == int(np.argmax(one_shot))
    for token, entry in got.items():
        assert abs(entry.logprob - lp[token]) < 1e-4
    assert abs(lp[ref["greedy_7"][0]] - reference(CASE)["logits_70"][-1].max()) >= 0   # shapes sanity
    np.testing.assert_allclose(one_shot, ref["logits_70"][-1], atol=1e-3)


def test_data_parallel_replicas_match_single_replica():
    """dp=2 x tp=2 on 4 devices: requests spread over both replicas, outputs equal dp=1."""
    ps = prompts(6, seed=51)
    want = [o.outputs[0].token_ids for o in llm(2).generate(ps, GREEDY)]
    model = LLM(fixture_dir(CASE), tensor_parallel_size=2, skip_tokenizer_init=True,
                **engine_args(data_parallel_size=2, max_num_seqs=4))
    seen = set()
    model.engine.observer.on_first_token = lambda req: seen.add(req.replica)
    got = [o.outputs[0].token_ids for o in model.generate(ps, GREEDY)]
    assert got == want
    assert seen == {0, 1}


def test_decode_prefill_budget_bounds_the_chunk_beside_decodes():
    """With decode_prefill_budget, a step that decodes prefills at most that many prompt tokens; a step with
    nothing decoding takes the whole budget. Mixed, the chunk beside decode rows has the budget's shape even where
    the decode rows leave the step less. Out-of-range values are refused."""
    from qwen35_jax.engine.engine import EngineArgs
    from qwen35_jax.engine.scheduler import Request, Scheduler
    sched = Scheduler(num_slots=4, num_pages=64, page_size=16, max_model_len=512, max_num_batched_tokens=128,
                      decode_buckets=[1, 2, 4], prefill_buckets=[(1, 32), (1, 64), (1, 128)],
                      decode_prefill_budget=32)
    params = SamplingParams(max_tokens=8)
    long = Request("long", list(range(400)), params, seed=0, max_tokens=8)
    sched.add(long)
    plan = sched.schedule()
    assert not plan.decode and plan.prefill[0].length == 128      # nothing decodes: the whole budget
    long.num_computed += 128
    short = Request("short", [1, 2, 3], params, seed=0, max_tokens=8)
    short.status, short.num_computed, short.num_sampled, short.slot = Status.RUNNING, 3, 1, 2
    sched.running.append(short)
    plan = sched.schedule()
    assert plan.decode == [short] and [c.length for c in plan.prefill] == [32]
    sched.mixed = [(1, 16), (1, 32)]    # mixed steps: one row up to the budget beside the decode rows, whatever
    sched.max_num_batched_tokens = 32    # else the step holds
    plan = sched.schedule()
    assert plan.decode == [short] and plan.prefill_shape == (1, 32) and [c.length for c in plan.prefill] == [32]
    long.num_computed = 390                             # 10 tokens left: the smallest shape that holds them
    plan = sched.schedule()
    assert plan.prefill_shape == (1, 16) and [c.length for c in plan.prefill] == [10]
    for bad in (16, 4096):
        with pytest.raises(ValueError, match="decode_prefill_budget"):
            EngineArgs(max_num_batched_tokens=2048, min_prefill_tokens=32, decode_prefill_budget=bad).validate()


def test_prefill_bucket_floor():
    """128 tokens on GPU (weight-bound there), 32 elsewhere; never above the step budget; an explicit value wins
    and is checked against the budget."""
    from qwen35_jax.engine.engine import EngineArgs
    assert EngineArgs().prefill_floor("cpu") == 32 and EngineArgs().prefill_floor("gpu") == 128
    assert EngineArgs(max_num_batched_tokens=64).prefill_floor("gpu") == 64
    assert EngineArgs(min_prefill_tokens=16).prefill_floor("gpu") == 16
    with pytest.raises(ValueError, match="min_prefill_tokens"):
        EngineArgs(min_prefill_tokens=4096, max_num_batched_tokens=2048).validate()


@contextlib.contextmanager
def without_persistent_cache():
    """JAX's persistent cache off for a while: every compile inside is a fresh one (the executable cache stores only
    those; see executor.ExecutableCache)."""
    from jax._src import compilation_cache
    compilation_cache.reset_cache()
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()


def test_warm_start_loads_serialized_executables(tmp_path):
    """A second engine of the same model and shapes (tp=2: the executables are loaded onto the mesh's 2 of 8
    devices) loads every bucket's executable from the executable cache, without tracing, lowering or compiling,
    and generates the same tokens; an unreadable entry is a logged miss, compiled and written again."""
    from qwen35_jax.engine.engine import EngineArgs, build_engine
    from qwen35_jax.engine.executor import ExecutableCache

    def engine(kernel_config=KernelConfig()):
        e = build_engine(fixture_dir(CASE), EngineArgs(
            tensor_parallel_size=2, kernel_config=kernel_config, skip_tokenizer_init=True, **engine_args(
                precompile=False, max_num_seqs=2, max_num_batched_tokens=32, max_prefill_rows=1)))      # 5 buckets
        e.executor.exe_cache = ExecutableCache(str(tmp_path))
        return e

    ps = prompts(3, seed=9)
    tokens = lambda e: [list(o.outputs[0].token_ids) for o in e.generate(ps, [GREEDY] * 3)]
    with without_persistent_cache():
        first = engine()
        first.executor.precompile()
        keys = first.executor.keys()
        assert (first.executor.exe_cache.hits, first.executor.exe_cache.misses) == (0, len(keys))
        want = tokens(first)
        broken = os.path.join(tmp_path, first.executor._cache_key(keys[0]) + ".exe")
        first.shutdown()

        second = engine()
        events = []
        listener = lambda name, secs, **kw: events.append(name) if "compile" in name or "trace" in name else None
        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            second.executor.precompile()
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)
        assert (second.executor.exe_cache.hits, second.executor.exe_cache.misses) == (len(keys), 0)
        assert events == []
        before = jax.tree.leaves(second.executor.state)
        assert tokens(second) == want
        assert all(x.is_deleted() for x in before)                      # loaded executables still donate the state
        second.shutdown()

        open(broken, "wb").write(b"not an executable")
        third = engine()
        third.executor.precompile()
        assert (third.executor.exe_cache.hits, third.executor.exe_cache.misses) == (len(keys) - 1, 1)
        assert tokens(third) == want
        third.shutdown()
        assert open(broken, "rb").read(4) != b"not "                   # compiled and written again

        # An engine built with another kernel configuration (a variant, as bench/ab_decode.py builds them) is not
        # served the executables compiled for the default one.
        other = engine(KernelConfig(xla_options={"xla_backend_optimization_level": 2}))
        other.executor.lazy = True
        assert tokens(other) == want
        assert other.executor.exe_cache.hits == 0 and other.executor.exe_cache.misses > 0
        other.shutdown()


def test_packed_step_inputs_round_trip():
    """A step's host inputs travel as one int32 array: every dtype the engine sends comes back bit for bit."""
    from qwen35_jax.engine.executor import pack_rows, unpack_rows
    rng = np.random.default_rng(3)
    tree = (rng.integers(-2**31, 2**31 - 1, size=(4, 3), dtype=np.int32),
            np.array([0.5, -0.0, np.nan, np.inf], np.float32), np.array([0, 1, 2**32 - 1, 7], np.uint32),
            np.array([True, False, True, False]), rng.integers(0, 9, size=4).astype(np.int32))
    packed, layout = pack_rows(tree)
    assert packed.dtype == np.int32 and packed.shape == (4, 3 + 4)
    back = jax.jit(lambda x: unpack_rows(x, layout))(packed)
    for want, got in zip(tree, back):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8))


def test_staged_step_inputs():
    """KernelConfig.staged_inputs: the inputs are copied into one device buffer per bucket that keeps its address
    from step to step; the tokens (greedy and seeded) equal the default path's, with mixed steps (a 200-token
    prompt's chunks inside the others' decode steps, decode_prefill_budget 32) staged as well."""
    ps = prompts(3, seed=61) + [np.random.default_rng(2).integers(2, 250, 200).tolist()]
    seeded = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    params = [GREEDY, seeded, GREEDY, GREEDY]
    lazy = lambda **kw: LLM(fixture_dir(CASE), skip_tokenizer_init=True, **engine_args(precompile=False, **kw))
    default = lazy()
    want = [o.outputs[0].token_ids for o in default.generate(ps, params)]
    default.shutdown()
    # the same step executables plus one stager each
    model = lazy(kernel_config=KernelConfig(staged_inputs=True), decode_prefill_budget=32)
    ex = model.engine.executor
    assert ex.staged
    assert [o.outputs[0].token_ids for o in model.generate(ps, params)] == want
    assert model.engine.stats.mixed_steps > 0
    addresses = {k: b.unsafe_buffer_pointer() for k, b in ex._input_bufs.items()}
    assert {k[0][0] for k in addresses} >= {"decode", "prefill", "mixed"}
    assert [o.outputs[0].token_ids for o in model.generate(ps, params)] == want       # the buckets used again
    assert {k: ex._input_bufs[k].unsafe_buffer_pointer() for k in addresses} == addresses
    model.shutdown()


def test_kernel_config():
    """KernelConfig: fields named as text (the --kernel-config flag, benchmarks), typed and checked; what differs
    from the defaults reads back in the same form; bad names, values and combinations are refused."""
    c = KernelConfig.parse("decode_split_k=2 gdn_decode.bv=16 xla_options.xla_gpu_enable_pdl=false "
                           "decode_attention=none attention_prologue=false", KernelConfig(backend="pallas_interpret"))
    assert (c.decode_split_k, c.gdn_decode.bv, c.decode_attention, c.attention_prologue) == (2, 16, None, False)
    assert c.xla_options == (("xla_gpu_enable_pdl", False),)
    assert KernelConfig.parse(c.resolved().changes(), KernelConfig(backend="pallas_interpret")) == c
    assert KernelConfig().resolved().changes() == ""
    off = KernelConfig.parse("expert_gemm=none gemv=none")          # a configuration that is off, then set
    on = KernelConfig.parse("expert_gemm.block_n=32 gemv.block_k=64", off)
    assert (on.expert_gemm.block_n, on.expert_gemm.block_k, on.gemv.block_k, on.gemv.block_n) == (32, 128, 64, 64)
    for bad, match in [("foo=1", "no field 'foo'"), ("gdn_decode=3", "set its fields"), ("staged_inputs=maybe",
                       "not a boolean"), ("decode_split_k=0", "decode_split_k must be >= 1"), ("x", "<field>=<value>"),
                       ("backend=cuda", "must be one of"), ("staged_inputs.x=1", "has no fields")]:
        with pytest.raises(ValueError, match=match):
            KernelConfig.parse(bad)
    with pytest.raises(ValueError, match="attention_prologue"):
        KernelConfig(backend="pallas_interpret", decode_attention=None).resolved()
    with pytest.raises(ValueError, match="needs a GPU"):
        KernelConfig(backend="pallas").resolved()


def test_unsupported_shapes_fail_early(tmp_path):
    """A model whose dimensions the chosen kernels cannot run is refused by build_engine before any weight is read
    or anything compiled, naming the dimension and the backend that runs it."""
    import json

    from qwen35_jax.engine.engine import EngineArgs, build_engine
    raw = json.load(open(os.path.join(fixture_dir(CASE), "config.json")))
    text = raw.get("text_config", raw)
    text["linear_value_head_dim"] = 24
    os.makedirs(tmp_path / "m")
    json.dump(raw, open(tmp_path / "m" / "config.json", "w"))          # no weights: they must not be read
    with pytest.raises(ValueError, match=r"linear_value_head_dim=24 is not a power of two.*'reference' backend"):
        build_engine(str(tmp_path / "m"), EngineArgs(kernel_config=KernelConfig(backend="pallas_interpret")))


def test_xla_options():
    """KernelConfig.xla_options reach the step executables' compile as typed XLA options (an unknown one fails
    that compile, naming it)."""
    lazy = lambda opts: LLM(fixture_dir(CASE), skip_tokenizer_init=True,
                            **engine_args(precompile=False, kernel_config=KernelConfig(xla_options=opts)))
    model = lazy({"xla_backend_optimization_level": 2})
    assert model.engine.executor._compiler_options(("decode", 1, "greedy")) == {"xla_backend_optimization_level": 2}
    out = model.generate(prompts(1, seed=3), GREEDY)[0].outputs[0].token_ids
    assert len(out) == GREEDY.max_tokens
    model.shutdown()
    model = lazy({"xla_no_such_option_anywhere": 1})
    assert model.generate(prompts(1, seed=3), GREEDY)[0].outputs[0].finish_reason == "error"
    assert "xla_no_such_option_anywhere" in str(model.engine.error)
    model.shutdown()


def test_decode_split_k_buckets():
    """Kernels.split_k from split_k_from rows: those decode buckets compile with XLA's own K splits off (the option
    reaches the compile, which the CPU accepts), the others as before, prefill with cuBLAS GEMMs alone; greedy output
    is unchanged."""
    split = KernelConfig(decode_split_k=2, decode_split_k_from=4)
    model = LLM(fixture_dir(CASE), skip_tokenizer_init=True, **engine_args(precompile=False, kernel_config=split))
    ex = model.engine.executor
    assert (ex.kernels.split_k, ex.kernels.split_k_from) == (2, 4)
    forced = {"xla_gpu_experimental_force_split_k": 1}
    for b in ex.decode_buckets:
        assert ex._compiler_options(("decode", b, "greedy")) == (forced if b >= 4 else {})
    assert ex._compiler_options(("prefill", 8, 64)) == {"xla_gpu_enable_triton_gemm": False}
    ps = prompts(6, seed=5)
    got = [o.outputs[0].token_ids for o in model.generate(ps, GREEDY)]
    model.shutdown()
    model = LLM(fixture_dir(CASE), skip_tokenizer_init=True,
                **engine_args(precompile=False, kernel_config=KernelConfig(decode_split_k=1)))
    assert [o.outputs[0].token_ids for o in model.generate(ps, GREEDY)] == got
    model.shutdown()


def test_decode_min_rows_pads_one_row_steps():
    """KernelConfig.decode_min_rows (default 2): the smallest decode bucket, where a lone request decodes beside a
    padding row on the null slot; its tokens (greedy, seeded) are those of an engine that decodes it alone (1)."""
    ps = prompts(2, seed=71)
    seeded = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)
    ex = llm(1).engine.executor
    assert ex.decode_buckets[0] == 2
    one = np.zeros(1, np.int32)
    with pytest.raises(ValueError, match=r"decode bucket 1 is not one of this engine's \[2, "):
        ex.decode(1, one, one, np.zeros((1, ex.pages_per_seq), np.int32), host_batch([], 1))
    want = [llm(1).generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(ps, (GREEDY, seeded))]
    model = LLM(fixture_dir(CASE), skip_tokenizer_init=True,
                **engine_args(precompile=False, kernel_config=KernelConfig(decode_min_rows=1)))
    assert model.engine.executor.decode_buckets[0] == 1
    assert [model.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(ps, (GREEDY, seeded))] == want
    model.shutdown()
    with pytest.raises(ValueError, match="decode_min_rows must be a power of two"):
        KernelConfig(decode_min_rows=3)

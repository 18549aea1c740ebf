"""Long context (issue 39) at real shapes with random weights, on one GPU.

Parts (--parts), each recorded in one table:
- tiles: the prefill attention kernel's TFLOP/s on one causal --floor-chunk chunk for each tile configuration of
  bench/kernel_sweeps.py, at the config's query heads and at G = 6 (27B's grouping), and cuDNN's flash attention
  on the same chunk with the pages gathered into contiguous K / V first (the issue's other candidate).
- ttft: time to the first token of one prompt of each --lens length (max_tokens=1, prefill chunks of --chunk
  tokens), with the prefill attention kernel and with the jnp attention (KernelConfig.prefill_attention=None, up
  to --jnp-max tokens); HF transformers + fla in the same run (bench/hf_baseline.py's child, --hf-lens) where it
  fits; and the prefill's compute floor: the decoder's GEMM FLOPs at this machine's measured bf16 GEMM rate plus
  the causal attention FLOPs at the prefill kernel's own rate (measured on one 8k chunk). For --trace-lens, one
  more request under the profiler gives the device's span (first kernel start to last kernel end), its kernels'
  time, and the host's lead before the first kernel and tail after the last, beside the TTFT: what the engine adds
  around the executables, measured in the same process.
- decode: the decode step at --decode-batches rows with --decode-context tokens of context each (positions set
  directly, no prefill), against its floor (weights + GDN state + K/V read, over the measured copy bandwidth).
- tpot: --tpot-rows requests decoding, then a --tpot-prompt-token prompt arrives; the time per output token of
  the decoding rows before it and while it prefills (p50, p99), and its TTFT, for each --budgets value of
  decode_prefill_budget, each cap with mixed steps and with the chunk and the decode rows apart (--tpot-steps; set
  between runs on one engine, which compiles on first use: a warm-up prompt compiles each setting's steps first).
- chunktiles: the prefill attention kernel alone on each --steps-chunks chunk at the end of a --decode-context
  context (as a mixed step runs it) for each tile configuration, against the layer's K/V copy floor, and on a causal
  --floor-chunk chunk; --pick writes the --kernel-config text of the fastest on short chunks.
- steps: the mixed step against its parts, called directly: the decode step of --tpot-rows rows, the prefill chunk
  alone and the two as one mixed step, per --steps-chunks length at each --steps-contexts context; with
  --steps-profile, the device time per scope of the decode step and of the shortest and longest mixed steps (10
  calls traced each), sorted by what the shortest mixed step adds.

    python bench/long_context.py --config bench/configs/qwen3.5-9b.json --record
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import os
import statistics
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import results  # noqa: E402
from bench.common import add_kernel_args, config_dir, kernel_config, prompt_ttfts, random_engine  # noqa: E402
from bench.hf_baseline import run_hf  # noqa: E402
from bench.kernel_sweeps import prefill_attention_sweep  # noqa: E402
from bench.throughput import Row, copy_bandwidth, time_decode  # noqa: E402
from bench.timing import traced  # noqa: E402
from qwen35_jax.engine.executor import pow2_buckets  # noqa: E402
from qwen35_jax.engine.sampler import host_batch, host_batch_rows  # noqa: E402
from qwen35_jax.model.forward import Batch  # noqa: E402
from qwen35_jax.tools import profile_trace as pt  # noqa: E402
from qwen35_jax.tools.profile import decode_rows, start_profile, steady_step_seconds, stop_profile  # noqa: E402
from pallas_kernels.prefill_attention import paged_prefill_attention  # noqa: E402
from qwen35_jax.engine.engine import EngineArgs, Observer  # noqa: E402
from qwen35_jax.engine.sampling_params import SamplingParams  # noqa: E402
from qwen35_jax.model.config import load_config  # noqa: E402
from qwen35_jax.tools.profile import decode_floor_bytes  # noqa: E402

ints = lambda text: [int(x) for x in text.split(",") if x]


def free(engine):
    engine.shutdown()
    gc.collect()


def warm_copies(engine):
    """Compile the prefix cache's snapshot copies up front (these engines compile on first use): a finished
    request's save otherwise compiles in the next request's time."""
    if engine.executor.snaps is not None:
        engine.executor.precompile(progress=False, kinds=("save", "restore"))


def ttft(args, cfg, kc, lens, weights=None, trace_lens=()):
    """({length: median seconds to the first token}, the engine's weights, {length: (device span s, kernels s)} of
    one traced request for each of trace_lens) for one kernel configuration."""
    engine = random_engine(args.config, EngineArgs(
        max_model_len=min(max(lens) + 16, cfg.max_position_embeddings), max_num_seqs=1,
        max_num_batched_tokens=args.chunk, max_prefill_rows=1, precompile=False,
        enable_prefix_caching=args.prefix_caching, kernel_config=kc), weights=weights)
    warm_copies(engine)
    out = {}
    for n, times in prompt_ttfts(engine, lens, args.chunk, args.reps).items():
        out[n] = statistics.median(times)
        print(f"ttft {kc.changes() or 'default'} {n}: {[round(t, 3) for t in times]} s", flush=True)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    rng = np.random.default_rng(1)                  # prompts of their own: none the prefix cache has seen
    run = lambda n: engine.generate([rng.integers(0, engine.cfg.vocab_size, n).tolist()], [params])
    device = {}
    for n in trace_lens:
        device[n] = traced_request(lambda n=n: run(n))
        print(f"ttft traced {n}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in device[n].items()), flush=True)
    w = engine.weights
    free(engine)
    return out, w, device


def traced_request(run) -> dict:
    """One request under the profiler, its time laid out (seconds): `request` the host's call, `span` its first
    kernel's start to its last kernel's end and `kernels` their sum, `lead` the call's start to the first kernel,
    `tail` the last kernel's end to the call's return. The profiler runs XLA's command buffers kernel by kernel and
    adds its own host work, so all of these may exceed an untraced request's."""
    def annotated():
        with jax.profiler.TraceAnnotation("ttft_request"):
            run()             # generate returns once the token is home

    trace = traced(annotated, lambda *_: None, annotations=("ttft_request",))
    (req,) = trace.annotations
    events = [e for e in trace.events if req.start_ns <= e.start_ns <= req.end_ns]
    first, last = min(e.start_ns for e in events), max(e.end_ns for e in events)
    return {"request": (req.end_ns - req.start_ns) / 1e9, "span": (last - first) / 1e9,
            "kernels": sum(e.self_ns for e in events) / 1e9, "lead": (first - req.start_ns) / 1e9,
            "tail": (req.end_ns - last) / 1e9}


def rate(fn, flops: float, calls: int = 10) -> float:
    """FLOP/s of fn() (compiled by a first call), back-to-back calls."""
    jax.block_until_ready(fn())
    t0 = time.perf_counter()
    for _ in range(calls):
        out = fn()
    jax.block_until_ready(out)
    return flops * calls / (time.perf_counter() - t0)


def attention_rate(cfg, config, t: int) -> float:
    """FLOP/s of the prefill attention kernel (tiles `config`) on one causal chunk of t tokens at cfg's heads
    (interpret mode off the GPU: a smoke run)."""
    hq, hkv, d, ps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 16
    key = jax.random.key(0)
    q = jax.random.normal(key, (1, t, hq, d), jnp.bfloat16)
    kv = jax.random.normal(key, (hkv, 1 + t // ps, ps, d), jnp.bfloat16)
    pages = jnp.arange(1, 1 + t // ps, dtype=jnp.int32)[None]
    positions = jnp.arange(t, dtype=jnp.int32)[None]
    attn = jax.jit(lambda *x: paged_prefill_attention(*x, config=config, interpret=jax.default_backend() != "gpu"))
    return rate(lambda: attn(q, kv, kv, pages, positions, jnp.array([t], jnp.int32)), 2 * hq * d * t * (t + 1))


def cudnn_rate(cfg, t: int) -> float:
    """FLOP/s of the other candidate: cuDNN's flash attention (jax.nn.dot_product_attention) on the same chunk,
    after gathering the row's pages into contiguous K / V (it takes no page table). A chunk from position 0 only:
    its causal mask is cuDNN's top-left one (later chunks need a bottom-right mask). XLA's attention off the GPU."""
    hq, hkv, d, ps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 16
    key = jax.random.key(0)
    q = jax.random.normal(key, (1, t, hq, d), jnp.bfloat16)
    kv = jax.random.normal(key, (hkv, 1 + t // ps, ps, d), jnp.bfloat16)
    pages = jnp.arange(1, 1 + t // ps, dtype=jnp.int32)[None]
    impl = "cudnn" if jax.default_backend() == "gpu" else None

    def attn(q, k_pages, v_pages, pages):
        gather = lambda x: jnp.moveaxis(x[:, pages[0]].reshape(hkv, -1, d), 0, 1)[None]      # [1, ctx, Hkv, D]
        return jax.nn.dot_product_attention(q, gather(k_pages), gather(v_pages), is_causal=True, implementation=impl)

    f = jax.jit(attn)
    return rate(lambda: f(q, kv, kv, pages), 2 * hq * d * t * (t + 1))


def compute_floor(cfg, weights, kc, lens, t: int) -> tuple[dict, float, float, dict, float]:
    """({length: floor seconds}, GEMM FLOP/s, attention FLOP/s, {length: sustained floor seconds}, sustained GEMM
    FLOP/s): the decoder's GEMM FLOPs (2 per weight of every 2-D matrix of the layers, per token; the lm_head once)
    at the measured bf16 GEMM rate, plus the attention layers' causal FLOPs (2 Hq D n (n + 1) each: scores and
    values) at the prefill kernel's rate on one chunk of t tokens (interpret mode off the GPU: a smoke run). The
    rate is a burst of 10 GEMMs (~12 ms on an H100); the sustained one ~0.25 s of them, about as long as an 8k
    prefill, over which the card's clocks drop (an H100's 8k prefill ran its last layer's GEMMs ~11% slower than
    its first, bench/RESULTS.md)."""
    a = jnp.ones((8192, 8192), jnp.bfloat16)
    gemm = jax.jit(lambda x, y: x @ y)
    flops = 2 * 8192 ** 3
    gemm_rate = rate(lambda: gemm(a, a), flops)
    sustained = rate(lambda: gemm(a, a), flops, calls=max(10, round(0.25 * gemm_rate / flops)))
    attn_rate = attention_rate(cfg, kc.prefill_attention, t)
    hq, d = cfg.num_heads, cfg.head_dim
    per_token = 2 * sum(x.size for x in jax.tree.leaves(weights.layers) if x.ndim == 2)
    head = 2 * cfg.hidden_size * cfg.vocab_size
    layers = sum(k == "full_attention" for k in cfg.layer_types)
    at = lambda r: {n: (n * per_token + head) / r + layers * 2 * hq * d * n * (n + 1) / attn_rate for n in lens}
    return at(gemm_rate), gemm_rate, attn_rate, at(sustained), sustained


def decode_part(args, kc) -> list[dict]:
    rows = []
    ctx, ps = args.decode_context, 16
    for b in ints(args.decode_batches):
        pps = -(-(ctx + 64) // ps)
        row = {"batch": b, "context": ctx}
        try:
            engine = random_engine(args.config, EngineArgs(
                max_model_len=ctx + 64, max_num_seqs=b, max_num_batched_tokens=2048, max_prefill_rows=1,
                num_kv_pages=1 + b * pps, precompile=False, enable_prefix_caching=False, kernel_config=kc))
        except Exception as e:          # e.g. 16 rows of 128k do not fit an 80 GB card beside the weights
            row["step_ms"] = f"did not fit: {type(e).__name__}"
            rows.append(row)
            continue
        step = time_decode(engine, b, ctx, 20)["step"]
        floor = sum(decode_floor_bytes(engine.cfg, engine.weights, engine.executor.state, b, ctx).values())
        bw = copy_bandwidth()
        row.update(step_ms=step * 1e3, floor_ms=floor / bw * 1e3, over_floor=step / (floor / bw))
        print(row, flush=True)
        rows.append(row)
        free(engine)
    return rows


class Tokens(Observer):
    """Every output token's (time, request id, seconds since its request's last token)."""
    def __init__(self):
        self.events, self.lock = [], threading.Lock()

    def on_token(self, req, seconds_since_last):
        with self.lock:
            self.events.append((time.monotonic(), req.request_id, seconds_since_last))


def set_budget(engine, budget: int | None, mixed: bool):
    """Switch a lazily compiling engine to another decode_prefill_budget, with or without mixed steps (the settings
    EngineArgs fixes at start-up): the scheduler's budget and the mixed steps' shapes, as Engine sets them (the
    prefill buckets up to the budget all exist: the smallest bucket is the smallest cap)."""
    shapes = [(1, t) for t in pow2_buckets(engine.args.prefill_floor(), budget)] if budget and mixed else []
    engine.scheduler.decode_prefill_budget, engine.scheduler.mixed = budget, shapes
    engine.mixed_shapes = shapes
    engine.executor.mixed_shapes = tuple(shapes)


def chunk_tiles_part(args, cfg, kc) -> tuple[list[dict], str]:
    """The prefill attention kernel alone, one attention layer, for each tile configuration: ms per call of a
    short chunk (--steps-chunks) at the end of a --decode-context context, as a mixed step runs it, and the
    fraction of the copy floor (the layer's K/V read once), over 100 calls back to back (sub-ms calls: fewer are
    noise); TFLOP/s on a causal --floor-chunk chunk from position 0.
    Returns the rows and the pick: KernelConfig.parse's text of the tiles fastest over the short chunks among those
    within 10% of the default's TFLOP/s (empty when that is the default)."""
    hq, hkv, d, ps, ctx = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 16, args.decode_context
    chunks, bw, rows = ints(args.steps_chunks), copy_bandwidth(), []
    key = jax.random.key(0)
    kv = jax.random.normal(key, (hkv, 1 + ctx // ps, ps, d), jnp.bfloat16)
    pages = jnp.arange(1, 1 + ctx // ps, dtype=jnp.int32)[None]
    floor_ms = 2 * kv.nbytes / bw * 1e3
    configs = prefill_attention_sweep()
    for c in configs:
        attn = jax.jit(lambda *x, c=c: paged_prefill_attention(*x, config=c, interpret=jax.default_backend() != "gpu"))
        row = {"tiles": c.name}
        try:
            for t in chunks:
                q = jax.random.normal(key, (1, t, hq, d), jnp.bfloat16)
                positions = (ctx - t + jnp.arange(t, dtype=jnp.int32))[None]
                seconds = 1 / rate(lambda: attn(q, kv, kv, pages, positions, jnp.array([ctx], jnp.int32)), 1.0, 100)
                row[f"chunk{t}_ms"] = seconds * 1e3
                row[f"chunk{t}_floor"] = floor_ms / (seconds * 1e3)
            row["tflops_causal"] = attention_rate(cfg, c, args.floor_chunk) / 1e12
        except Exception as e:  # noqa: BLE001 (e.g. a tile past the shared memory: the table says so)
            row["failed"] = f"{type(e).__name__}: {str(e)[:80]}"
        print(row, flush=True)
        rows.append(row)
    ok = [(r, c) for r, c in zip(rows, configs) if "failed" not in r
          and r["tflops_causal"] >= 0.9 * rows[0].get("tflops_causal", float("inf"))]
    best = min(ok, key=lambda rc: sum(rc[0][f"chunk{t}_ms"] for t in chunks), default=(None, None))[1]
    pick = dataclasses.replace(kc, prefill_attention=best).changes() if best is not None else ""
    return rows, pick


def tpot_part(args, kc) -> list[dict]:
    """For each budget, with mixed steps and apart: n requests decode; a warm-up prompt of 4 budgets' tokens
    compiles what the setting runs (the engine compiles on first use); --tpot-base-s of their TPOT; then the long
    prompt: their TPOT until its first token, and its TTFT."""
    n, prompt = args.tpot_rows, args.tpot_prompt
    caps = [int(b) for b in args.budgets.split(",") if b != "none"]
    engine = random_engine(args.config, EngineArgs(       # the smallest prefill bucket fits the smallest cap
        max_model_len=prompt + 64, max_num_seqs=n + 1, max_num_batched_tokens=args.chunk, max_prefill_rows=1,
        min_prefill_tokens=min(caps, default=None), precompile=False, enable_prefix_caching=args.prefix_caching,
        kernel_config=kc))
    warm_copies(engine)
    obs = engine.observer = Tokens()
    rng = np.random.default_rng(1)
    vocab, rows = engine.cfg.vocab_size, []

    def first_token(length: int, timeout: float) -> float:
        done = threading.Event()
        t0 = time.monotonic()
        engine.add_request(rng.integers(0, vocab, length).tolist(), SamplingParams(max_tokens=1, ignore_eos=True),
                           lambda out: out.finished and done.set())
        if not done.wait(timeout):
            raise RuntimeError(f"a {length}-token prompt got no first token within {timeout} s")
        return time.monotonic() - t0

    modes = [{"mixed": True, "apart": False}[m] for m in args.tpot_steps.split(",")]
    settings = [(None, False)] * ("none" in args.budgets.split(",")) + [(c, m) for c in caps for m in modes]
    for budget, mixed in settings:
        set_budget(engine, budget, mixed)
        obs.events.clear()
        short = SamplingParams(max_tokens=args.tpot_max_tokens, temperature=0, ignore_eos=True)
        finished = set()
        ids = [engine.add_request(rng.integers(0, vocab, 256).tolist(), short,
                                  lambda out: out.finished and finished.add(out.request_id)) for _ in range(n)]
        deadline = time.monotonic() + 300
        while len({e[1] for e in obs.events}) < n:
            if time.monotonic() > deadline:
                raise RuntimeError("the decoding requests did not all start within 300 s")
            time.sleep(0.01)
        warm = first_token(4 * (budget or args.chunk), 600)
        t_base = time.monotonic()
        time.sleep(args.tpot_base_s)
        t_submit = time.monotonic()
        ttft_s = first_token(prompt, 900)
        t_done = t_submit + ttft_s
        early = len(finished)
        for rid in ids:
            engine.abort(rid)
        with obs.lock:
            base = [dt for t, _, dt in obs.events if t_base <= t < t_submit]
            during = [dt for t, _, dt in obs.events if t_submit <= t <= t_done]
        q = lambda xs, p: float(np.percentile(xs, p)) * 1e3 if xs else float("nan")
        row = {"decode_prefill_budget": budget or f"none ({args.chunk})",
               "steps": "mixed" if engine.mixed_shapes else "apart", "tpot_p50_ms": q(base, 50),
               "tpot_p99_ms": q(base, 99), "during_p50_ms": q(during, 50), "during_p99_ms": q(during, 99),
               "during_p99_over_p50": q(during, 99) / q(base, 50), "long_ttft_s": ttft_s,
               "rows_done_before_ttft": early, "warmup_s": warm}
        print(row, flush=True)
        rows.append(row)
    free(engine)
    return rows


def steps_part(args, kc) -> tuple[list[dict], dict]:
    """The mixed step against its parts, called directly (no scheduler): --tpot-rows decode rows at a 512-token
    context and one chunk row of each --steps-chunks length at each --steps-contexts context. ms per call (steady
    state) of the decode step alone, the prefill chunk alone, and the mixed step of both. With --steps-profile,
    {name: {scope: device ms}} of the decode step and the mixed steps at the first and the last context and chunk."""
    n, chunks, contexts = args.tpot_rows, ints(args.steps_chunks), ints(args.steps_contexts)
    ps, short = 16, 512
    per_row = short // ps + 1
    long_pages = -(-(max(contexts) + max(chunks)) // ps)
    engine = random_engine(args.config, EngineArgs(
        max_model_len=max(contexts) + max(chunks) + 64, max_num_seqs=n + 1, max_num_batched_tokens=max(chunks),
        max_prefill_rows=1, min_prefill_tokens=min(chunks), decode_prefill_budget=max(chunks), page_size=ps,
        num_kv_pages=1 + n * per_row + long_pages, precompile=False, enable_prefix_caching=False, kernel_config=kc))
    ex, pps = engine.executor, engine.pages_per_seq
    b, slots, pages = decode_rows(ex, n, per_row)
    positions = np.where(slots > 0, short, 0).astype(np.int32)
    sp = host_batch([Row() for _ in range(n)], b)
    chunk_pages = np.zeros((1, pps), np.int32)
    chunk_pages[0, :long_pages] = 1 + n * per_row + np.arange(long_pages)
    psp, finishing = host_batch_rows([None]), np.zeros(1, np.bool_)

    def timed(call) -> float:
        for _ in range(3):
            o = call()
        jax.block_until_ready(o)

        def burst(k):
            t0 = time.perf_counter()
            for _ in range(k):
                o = call()
            jax.block_until_ready(o)
            return time.perf_counter() - t0
        return steady_step_seconds(burst, 20)[0] * 1e3

    def chunk_arrays(c: int, t: int) -> tuple:        # one t-token chunk row at context c, in slot n + 1
        return (np.ones((1, t), np.int32), np.array([c], np.int32), np.array([t], np.int32),
                np.array([n + 1], np.int32), chunk_pages)

    rows, dec = [], (slots, positions, pages, sp)
    decode_ms = timed(lambda: ex.decode(b, *dec))
    for c in contexts:
        for t in chunks:
            arrays = chunk_arrays(c, t)
            chunk = (Batch(*arrays), finishing, psp)
            prefill_ms = timed(lambda: ex.prefill((1, t), *arrays, finishing, psp))
            mixed_ms = timed(lambda: ex.mixed(b, (1, t), dec, chunk))
            row = {"context": c, "chunk": t, "decode_ms": decode_ms, "prefill_ms": prefill_ms,
                   "apart_ms": decode_ms + prefill_ms, "mixed_ms": mixed_ms, "mixed_over_decode": mixed_ms / decode_ms}
            print(row, flush=True)
            rows.append(row)
    scopes = {}
    if args.steps_profile:          # device ms per scope: the decode step, the shortest and the longest mixed step
        texts = [e.as_text() for e in ex.compiled.values()]
        calls = {"decode": lambda: ex.decode(b, *dec)}
        for c, t in dict.fromkeys([(contexts[0], chunks[0]), (contexts[-1], chunks[-1])]):
            chunk = (Batch(*chunk_arrays(c, t)), finishing, psp)
            calls[f"mixed {c}/{t}"] = functools.partial(ex.mixed, b, (1, t), dec, chunk)
        for name, call in calls.items():
            start_profile(os.path.join(args.steps_profile, name.replace(" ", "_").replace("/", "_")))
            for _ in range(10):
                o = call()
            jax.block_until_ready(o)
            session = stop_profile()
            events = pt.resolve(pt.load_trace(session).events, pt.HloIndex(texts))
            scopes[name] = {k: v / 10 for k, v in pt.by_scope(events).items()}
            print(name, {k: round(v, 3) for k, v in scopes[name].items()}, flush=True)
    free(engine)
    return rows, scopes


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--parts", default="tiles,ttft,decode,tpot")
    ap.add_argument("--lens", default="8192,32768,131072,262143", help="262143 + its token: the whole window")
    ap.add_argument("--jnp-max", type=int, default=32768, help="the jnp attention's longest prompt")
    ap.add_argument("--hf-lens", default="8192,32768", help="HF + fla's prompts (empty: no HF run)")
    ap.add_argument("--hf-device", default="cuda")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--trace-lens", default="8192,32768", help="lengths whose TTFT also gets one traced request")
    ap.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--decode-context", type=int, default=131072)
    ap.add_argument("--decode-batches", default="1,16")
    ap.add_argument("--tpot-rows", type=int, default=16)
    ap.add_argument("--tpot-prompt", type=int, default=131072)
    ap.add_argument("--tpot-base-s", type=float, default=1.0, help="seconds of decoding timed before the prompt")
    ap.add_argument("--tpot-max-tokens", type=int, default=8192, help="the decoding requests' max_tokens")
    ap.add_argument("--floor-chunk", type=int, default=8192, help="the chunk the attention kernel's rate is timed on")
    ap.add_argument("--budgets", default="none,256,64", help="decode_prefill_budget values (each cap mixed and apart)")
    ap.add_argument("--steps-contexts", default="1024,131072", help="steps: the chunk row's contexts")
    ap.add_argument("--steps-chunks", default="32,64,256", help="steps: the chunk lengths (powers of two)")
    ap.add_argument("--steps-profile", default="", help="steps: trace the decode and mixed steps under this directory")
    ap.add_argument("--tpot-steps", default="mixed,apart", help="tpot: each cap with mixed steps, apart, or both")
    ap.add_argument("--pick", default="", help="chunktiles: write the picked tiles' --kernel-config text here")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="ttft / tpot: the prefix cache on (the engine default; off otherwise)")
    ap.add_argument("--record", action="store_true")
    add_kernel_args(ap)
    args = ap.parse_args()
    kc = kernel_config(args).resolved()
    cfg = load_config(config_dir(args.config))
    parts, tables, fields = args.parts.split(","), [], {"args": vars(args)}
    fmt = lambda rows: [{c: f"{v:.3f}" if isinstance(v, float) else v for c, v in r.items()} for r in rows]

    def flush():            # after each part: a run cut short by its time limit keeps the parts it finished
        body = (f"Model `{os.path.basename(args.config)}` shapes, random bf16 weights, kernels "
                f"{kc.changes() or 'default'}, prefix cache {'on' if args.prefix_caching else 'off'} (ttft, tpot)."
                f"\n\n" + "\n\n".join(tables))
        print(body, flush=True)
        if args.record:
            results.record("Long context (bench/long_context.py)", body, fields=fields)
    if "ttft" in parts:
        lens = ints(args.lens)
        hf = run_hf(args.config, args.hf_lens, args.reps, args.hf_device) if args.hf_lens else None
        traced = [n for n in ints(args.trace_lens) if n in lens]
        kernel, weights, device = ttft(args, cfg, kc, lens, trace_lens=traced)
        short = [n for n in lens if n <= args.jnp_max]
        jnp_path = ttft(args, cfg, dataclasses.replace(kc, prefill_attention=None), short, weights)[0] if short else {}
        floor, gemm_rate, attn_rate, held, held_rate = compute_floor(cfg, weights, kc, lens, args.floor_chunk)
        hf_times = {int(k): statistics.median(v) for k, v in (hf or {}).get("times", {}).items()}
        nan = float("nan")
        rows = [{"prompt_tokens": n, "kernel_ms": kernel[n] * 1e3, "jnp_attention_ms": jnp_path.get(n, nan) * 1e3,
                 "hf_fla_ms": hf_times.get(n, nan) * 1e3, "floor_ms": floor[n] * 1e3,
                 "floor_over_kernel": floor[n] / kernel[n], "sustained_floor_ms": held[n] * 1e3,
                 "sustained_floor_over_kernel": held[n] / kernel[n], "hf_over_kernel": hf_times.get(n, nan) / kernel[n],
                 "device_span_ms": device.get(n, {}).get("span", nan) * 1e3,
                 "device_kernels_ms": device.get(n, {}).get("kernels", nan) * 1e3,
                 "traced_lead_ms": device.get(n, {}).get("lead", nan) * 1e3,
                 "traced_tail_ms": device.get(n, {}).get("tail", nan) * 1e3}
                for n in lens]
        tables.append(f"Time to first token (one prompt, chunks of {args.chunk}; floor: GEMMs at "
                      f"{gemm_rate / 1e12:.3g} TFLOP/s measured over 10 GEMMs (sustained floor: "
                      f"{held_rate / 1e12:.3g} TFLOP/s over ~0.25 s of them), attention at the kernel's "
                      f"{attn_rate / 1e12:.3g} "
                      f"TFLOP/s on a {args.floor_chunk}-token chunk; HF: torch {hf and hf.get('torch')}, fla "
                      f"{hf and hf.get('fla')})"
                      f"\n\n" + results.table(fmt(rows), list(rows[0])))
        fields.update(ttft=rows, gemm_rate=gemm_rate, attn_rate=attn_rate, sustained_gemm_rate=held_rate)
        del weights
        gc.collect()
        flush()
    if "tiles" in parts:            # the prefill attention kernel's tile configurations, at 9B and 27B heads
        rows = []
        for c in prefill_attention_sweep():
            row = {"tiles": c.name}
            for hq in (cfg.num_heads, 6 * cfg.num_kv_heads):
                try:
                    row[f"tflops_hq{hq}"] = attention_rate(dataclasses.replace(cfg, num_heads=hq), c,
                                                           args.floor_chunk) / 1e12
                except Exception as e:  # noqa: BLE001 (e.g. a tile past the shared memory: the table says so)
                    row[f"tflops_hq{hq}"] = f"failed: {type(e).__name__}: {str(e)[:80]}"
            print(row, flush=True)
            rows.append(row)
        row = {"tiles": "cuDNN flash attention, pages gathered first (jax.nn.dot_product_attention)"}
        for hq in (cfg.num_heads, 6 * cfg.num_kv_heads):
            try:
                row[f"tflops_hq{hq}"] = cudnn_rate(dataclasses.replace(cfg, num_heads=hq), args.floor_chunk) / 1e12
            except Exception as e:      # cuDNN refuses some shapes (head dim, GQA): say so in the table
                row[f"tflops_hq{hq}"] = f"failed: {type(e).__name__}: {str(e)[:80]}"
        print(row, flush=True)
        rows.append(row)
        tables.append(f"Prefill attention kernel tiles, one causal {args.floor_chunk}-token chunk\n\n"
                      + results.table(fmt(rows), list(rows[0])))
        fields["tiles"] = rows
        flush()
    if "chunktiles" in parts:
        rows, pick = chunk_tiles_part(args, cfg, kc)
        if args.pick:
            with open(args.pick, "w") as f:
                f.write(pick)
        tables.append(f"Prefill attention kernel tiles on short chunks at the end of a {args.decode_context}-token "
                      f"context (one layer; floor: its K/V read once at the measured copy bandwidth), and on a causal "
                      f"{args.floor_chunk}-token chunk. Picked: {pick or 'the default'}\n\n"
                      + results.table(fmt(rows), list(dict.fromkeys(c for r in rows for c in r))))
        fields.update(chunk_tiles=rows, chunk_tiles_pick=pick)
        flush()
    if "decode" in parts:
        rows = decode_part(args, kc)
        tables.append("Decode step at long context\n\n" + results.table(fmt(rows), list(rows[0])))
        fields["decode"] = rows
        flush()
    if "steps" in parts:
        rows, scopes = steps_part(args, kc)
        tables.append(f"The mixed step against its parts ({args.tpot_rows} decode rows at 512 tokens of context, one "
                      "chunk row)\n\n" + results.table(fmt(rows), list(rows[0])))
        if scopes:          # one row per scope, sorted by what the shortest mixed step adds to the decode step
            names = list(scopes)
            keys = sorted({k for v in scopes.values() for k in v},
                          key=lambda k: -(scopes[names[1]].get(k, 0) - scopes["decode"].get(k, 0)))
            table = [{"scope": k, **{f"{m} ms": v.get(k, 0.0) for m, v in scopes.items()}} for k in keys]
            tables.append("Device ms per scope (context/chunk of the chunk row), 10 calls traced each\n\n"
                          + results.table(fmt(table), list(table[0])))
        fields.update(steps=rows, step_scopes=scopes)
        flush()
    if "tpot" in parts:
        rows = tpot_part(args, kc)
        tables.append(f"TPOT of {args.tpot_rows} decoding requests while a {args.tpot_prompt}-token prompt "
                      f"prefills\n\n" + results.table(fmt(rows), list(rows[0])))
        fields["tpot"] = rows
        flush()


if __name__ == "__main__":
    main()

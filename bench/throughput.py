"""Engine throughput at real shapes with random weights (issue 4's benchmark; run on the GPU machine).

Measures, in one run: the device copy bandwidth; the precompile sweep cold (fresh persistent cache) and warm;
the decode step time at several batch sizes against its floor (weight bytes + GDN state read and written + KV
read, over the copy bandwidth); and a serving workload (C concurrent requests of P prompt tokens and O output
tokens through the engine), with the engine's host time per step.

    python bench/throughput.py --config bench/configs/qwen3.5-9b.json --record
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import results  # noqa: E402
from bench.common import add_kernel_args, kernel_config, random_engine  # noqa: E402
from bench.timing import slope_us  # noqa: E402
from qwen35_jax.engine.engine import Engine, EngineArgs  # noqa: E402
from qwen35_jax.engine.executor import pack_rows  # noqa: E402
from qwen35_jax.tools.profile import decode_floor_bytes, decode_rows, steady_step_seconds  # noqa: E402
from qwen35_jax.engine.sampler import host_batch, sampler_mode  # noqa: E402
from qwen35_jax.engine.sampling_params import SamplingParams  # noqa: E402


def copy_bandwidths(gib: float | None = None, calls: tuple[int, int] = (2, 12), reps: int = 7) -> dict[str, float]:
    """Bytes read + written per second by a large elementwise copy (the memory roofline XLA can reach), two ways,
    both from device time alone:
    'chained': the slope over two counts of chained out-of-place passes in one program (bench/timing.slope_us);
    'in place': the steady-state time (qwen35_jax.tools.profile.steady_step_seconds) of back-to-back calls of one
    donated pass (x * 2 written over x, as the profile's copy; ~0.5 ms each, so the host runs ahead and dispatch
    is not in it).
    The floor takes the higher ("max"): the in-place copy read 4.27-4.30 TB/s in the profiles where the chained
    one read 4.02-4.17 here (bench/runs/history.md), and a floor from the lower one would flatter the step.
    gib: the array's size, default 1 GiB on GPU, 1/16 elsewhere (CPU smoke runs of the benches)."""
    gib = gib or (1.0 if jax.default_backend() == "gpu" else 1 / 16)
    x = jnp.ones((int(gib * 2**30) // 4,), jnp.float32)
    nbytes = x.nbytes

    def make_prog(c):
        def prog(x):
            for _ in range(c):
                x = jax.lax.optimization_barrier(x * 1.0001)     # one pass each: no fusing them
            return x
        return prog
    chained = 2 * nbytes / (slope_us(make_prog, (x,), calls, reps) * 1e-6)
    step = jax.jit(lambda a: a * 2, donate_argnums=0)

    def burst(k):
        nonlocal x
        t0 = time.perf_counter()
        for _ in range(k):
            x = step(x)
        jax.block_until_ready(x)
        return time.perf_counter() - t0
    burst(1)                                                 # compile
    in_place = 2 * nbytes / steady_step_seconds(burst, 2 * calls[1], reps)[0]    # bursts of 24 and 48 calls
    return {"chained": chained, "in place": in_place, "max": max(chained, in_place)}


def copy_bandwidth(**kw) -> float:
    """The higher of the two copy bandwidths (copy_bandwidths), bytes/s: the floor of every bench."""
    return copy_bandwidths(**kw)["max"]


class Row:   # what host_batch reads from a request
    def __init__(self):
        self.params, self.seed, self.num_generated = SamplingParams(temperature=0), 0, 0


def time_decode(engine: Engine, batch: int, ctx: int, iters: int) -> dict[str, float]:
    """Seconds per decode step and the median host seconds of one dispatch call, for `batch` live rows at context
    ctx, back-to-back dispatches; twice: with the step's inputs as host arrays (as the engine passes them: a new
    device buffer every call) and packed into a device array made once (the same buffer every call). A dispatch much
    shorter than the step means the host is free to run ahead; one as long as the step means the executable
    synchronises with the host (a while / conditional). A dispatch that is much cheaper with resident inputs means
    the call's cost follows the input buffers' addresses (e.g. command buffers updated when they move), not the
    transfers' size (a few hundred bytes). "dispatches": the calls it made (warm-ups included), for traces of it."""
    ex = engine.executor
    b, slots, pages = decode_rows(ex, batch, engine.pages_per_seq)
    positions = np.where(slots > 0, ctx, 0).astype(np.int32)
    sp = host_batch([Row() for _ in range(batch)], b)
    key = ("decode", b, sampler_mode(sp))
    resident = jax.device_put(pack_rows((slots, positions, pages, sp))[0], ex.rows)
    calls = {"": lambda: ex.decode(b, slots, positions, pages, sp), "resident ": lambda: ex.call(key, resident)}
    out = {}
    for name, call in calls.items():
        for _ in range(3):
            o = call()
        jax.block_until_ready(o)
        times = []

        def burst(k):
            t0 = time.perf_counter()
            for _ in range(k):
                t = time.perf_counter()
                o = call()
                times.append(time.perf_counter() - t)
            jax.block_until_ready(o)
            return time.perf_counter() - t0
        out[name + "step"], out[name + "burst step"] = steady_step_seconds(burst, iters)
        out[name + "dispatch"] = float(np.median(times))
        out["dispatches"] = out.get("dispatches", 0) + 3 + len(times)
    return out


def empty_dispatch(engine: Engine, iters: int = 50) -> float:
    """Median host seconds of one call of an executable that takes the decode step's arguments (weights, donated
    state, packed host inputs of batch 1) and does nothing (outputs alias the donated state): the per-call cost of the
    argument list alone."""
    ex = engine.executor
    packed = pack_rows((np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros((1, engine.pages_per_seq), np.int32),
                        host_batch([Row()], 1)))[0]
    f = jax.jit(lambda w, s, ss, x: (s, ss), donate_argnums=(1, 2))
    exe = f.lower(ex.weights, ex.state, ex.sstate, packed).compile()
    calls = []
    for _ in range(iters):
        t = time.perf_counter()
        ex.state, ex.sstate = exe(ex.weights, ex.state, ex.sstate, packed)
        calls.append(time.perf_counter() - t)
    jax.block_until_ready(ex.state)
    return float(np.median(calls[5:]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="bench/configs/qwen3.5-9b.json")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-prefill-rows", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=1536)
    ap.add_argument("--compilation-cache-dir", default=None,
                    help="persistent XLA cache (must be empty for a cold sweep; default: a fresh temp dir)")
    ap.add_argument("--decode-steps", type=int, default=1)
    add_kernel_args(ap)
    ap.add_argument("--record", action="store_true", help="record the run under bench/runs/ (bench/results.py)")
    args = ap.parse_args()

    bws = copy_bandwidths()
    bw = bws["max"]
    print("copy bandwidth " + ", ".join(f"{k} {v / 1e12:.2f} TB/s" for k, v in bws.items()))
    cache = args.compilation_cache_dir or tempfile.mkdtemp(prefix="qwen35-xla-")
    os.makedirs(cache, exist_ok=True)
    cold_cache = not os.listdir(cache)
    eargs = EngineArgs(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, max_prefill_rows=args.max_prefill_rows,
                       decode_steps=args.decode_steps, compilation_cache_dir=cache, kernel_config=kernel_config(args))
    t0 = time.perf_counter()
    engine = random_engine(args.config, eargs)
    cfg, weights = engine.cfg, engine.weights
    print(f"random weights and precompile in {time.perf_counter() - t0:.1f}s")
    cold = engine.precompile_seconds
    n_exe = len(engine.executor.compiled)
    engine.executor.compiled.clear()
    jax.clear_caches()
    warm = engine.executor.precompile()
    print(f"precompile {n_exe} executables: {'cold' if cold_cache else 'pre-filled cache'} {cold:.1f}s, "
          f"warm cache {warm:.1f}s", flush=True)

    empty = empty_dispatch(engine)
    print(f"empty dispatch (the decode step's arguments, no work): {empty * 1e3:.2f} ms")
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(weights))
    ctx = args.prompt_len + args.output_len // 2
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        t = time_decode(engine, b, ctx, args.iters)
        dt = t["step"] / args.decode_steps
        floor_bytes = sum(decode_floor_bytes(cfg, weights, engine.executor.state, b, ctx).values())
        floor = floor_bytes / bw
        rows.append({"batch": b, "step ms": f"{dt * 1e3:.2f}", "floor ms": f"{floor * 1e3:.2f}",
                     "step / floor": f"{dt / floor:.2f}",
                     "burst ms": f"{t['burst step'] / args.decode_steps * 1e3:.2f}",
                     "dispatch ms": f"{t['dispatch'] * 1e3:.2f}",
                     "resident: step ms": f"{t['resident step'] / args.decode_steps * 1e3:.2f}",
                     "resident: dispatch ms": f"{t['resident dispatch'] * 1e3:.2f}",
                     "tok/s": f"{b / dt:.0f}",
                     "bytes/step GB": f"{floor_bytes / 1e9:.1f}"})
        print(rows[-1])

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, args.prompt_len).tolist() for _ in range(args.concurrency)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    engine.generate(prompts[:2], [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)] * 2)  # warm loop
    s0 = dict(vars(engine.stats))
    t0 = time.perf_counter()
    outs = engine.generate(prompts, [params] * len(prompts))
    wall = time.perf_counter() - t0
    steps = engine.stats.steps - s0["steps"]
    host = (engine.stats.host_seconds - s0["host_seconds"]) / max(steps, 1)
    wait = (engine.stats.wait_seconds - s0["wait_seconds"]) / max(steps, 1)
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs]
    tpot = [(o.metrics["last_token_time"] - o.metrics["first_token_time"]) / (len(o.outputs[0].token_ids) - 1)
            for o in outs]
    serve = {"requests": len(outs), "output tok/s": f"{gen / wall:.0f}", "wall s": f"{wall:.2f}",
             "TTFT median ms": f"{np.median(ttft) * 1e3:.0f}", "TPOT median ms": f"{np.median(tpot) * 1e3:.2f}",
             "engine steps": steps, "host ms/step": f"{host * 1e3:.2f}", "wait ms/step": f"{wait * 1e3:.2f}"}
    print(serve)
    engine.shutdown()

    variants = engine.kernel_config.changes()
    body = (f"Model: `{args.config}` shapes, random bf16 weights ({weight_bytes / 1e9:.1f} GB), kernel_backend="
            f"`{engine.kernel_config.backend}`{f' ({variants})' if variants else ''}, "
            f"decode_steps={args.decode_steps}. Copy bandwidth measured in this run "
            f"(read + write): {bws['chained'] / 1e12:.2f} TB/s chained in one program, {bws['in place'] / 1e12:.2f} "
            f"TB/s in place (donated, back to back); the floor takes the higher, {bw / 1e12:.2f} TB/s. "
            f"Floor = (weights, an untied embedding table only for its looked-up "
            f"rows, + GDN state read and written + KV read at context {ctx}) / copy bandwidth "
            f"(`qwen35_jax.tools.profile.decode_floor_bytes`). 'step ms': slope of wall time from bursts of "
            f"{args.iters} to "
            f"{2 * args.iters} back-to-back dispatches (median of 3 each), the steady-state step; 'burst ms': one "
            f"burst's wall time per step (the method of runs before 2026-12-02), which also carries the first "
            f"dispatch's host time and the final wait. 'dispatch ms': median host time of one dispatch call (much "
            f"less than the step: the host runs ahead of the device); 'resident:' the same with the step's inputs "
            f"put on the device once and passed again every call (the engine passes new host arrays each step). "
            f"An executable that takes the same arguments and does no work dispatches in {empty * 1e3:.2f} ms.\n\n"
            f"Precompile sweep ({n_exe} executables, {eargs.precompile_threads or 'default'} threads): "
            f"{'cold (empty persistent cache)' if cold_cache else 'first start (cache not empty)'} {cold:.1f} s, "
            f"warm persistent cache {warm:.1f} s.\n\n"
            + results.table(rows, list(rows[0])) + "\n\n"
            f"Serving workload: {args.concurrency} concurrent × {args.prompt_len}-token prompts × "
            f"{args.output_len} output tokens (greedy, ignore_eos), in-process engine. 'host ms/step' is host work "
            f"per engine step not overlapped by dispatch; 'wait ms/step' is time blocked on device results.\n\n"
            + results.table([serve], list(serve)))
    if args.record:       # a run with kernel variants records beside the default's section
        results.record("Engine throughput (bench/throughput.py)" + (f" {variants}" if variants else ""), body,
                       fields={"decode": rows, "serving": serve, "precompile_s": {"cold": cold, "warm": warm,
                                                                                   "cold_cache": cold_cache,
                                                                                   "executables": n_exe}})


if __name__ == "__main__":
    main()

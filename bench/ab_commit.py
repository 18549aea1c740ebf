"""A/B of two source trees (this one and another commit's), in alternating processes: the 9B decode step at some
batches and the GDN prefill kernel at one shape, on random weights.

Separate processes because two trees cannot be imported in one; alternating (A B A B ...), so drift of the machine
falls on both. Each child imports qwen35_jax and bench from its --root and prints one JSON line; the parent
reports the median per tree and the median of the per-round differences.

    bash bench/ab_tree.sh <commit> _ab/base        # an untracked tree small enough for the device
    python bench/ab_commit.py --base $PWD/_ab/base --rounds 3 --record
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(args):
    """Runs inside --root: times what the parent asked for and prints {"decode": {batch: ms}, "prefill": us}."""
    sys.path.insert(0, args.root)
    import jax
    import jax.numpy as jnp

    from bench.ab_decode import decode_call
    from qwen35_jax.engine import engine as engine_module
    from qwen35_jax.tools.profile import steady_step_seconds
    batches = [int(b) for b in args.batches.split(",")]
    raw = json.load(open(args.config))
    out = {"decode": {}, "prefill_us": None}
    if batches:
        kw = dict(max_model_len=args.context + 64, max_num_seqs=max(batches), precompile=False,
                  max_num_batched_tokens=max(256, max(batches)), max_prefill_rows=1,
                  compilation_cache_dir=args.cache, gpu_memory_utilization=args.gpu_memory_utilization)
        if hasattr(engine_module, "build_engine"):          # this tree's API
            from bench.common import random_engine
            engine = random_engine(raw, engine_module.EngineArgs(**kw))
        else:                                               # the API before build_engine
            import tempfile

            from qwen35_jax.model.config import ModelConfig
            from qwen35_jax.model.sharding import make_mesh
            from qwen35_jax.model.weights import random_weights
            d = tempfile.mkdtemp()
            json.dump(raw, open(os.path.join(d, "config.json"), "w"))
            weights = random_weights(ModelConfig.from_hf(raw), make_mesh(1), jnp.bfloat16)
            engine = engine_module.Engine(d, engine_module.EngineArgs(**kw), weights=weights)
        for b in batches:
            if getattr(engine.cfg, "moe", False):       # rows of one token would all route to the same experts
                from bench.ab_decode import distinct_tokens
                distinct_tokens(engine, b)
            call = decode_call(engine, b, args.context)
            jax.block_until_ready([call() for _ in range(3)])

            def burst(k, call=call):
                import time
                t = time.perf_counter()
                for _ in range(k):
                    o = call()
                jax.block_until_ready(o)
                return time.perf_counter() - t
            out["decode"][b] = steady_step_seconds(burst, args.iters)[0] * 1e3
        engine.shutdown()
    if args.prefill_tokens:
        from bench.timing import slope_us
        from pallas_kernels import gdn
        text = raw.get("text_config", raw)
        hk, hv = text["linear_num_key_heads"], text["linear_num_value_heads"]
        dk, dv, t = text["linear_key_head_dim"], text["linear_value_head_dim"], args.prefill_tokens
        ks = iter(jax.random.split(jax.random.key(0), 8))
        r = lambda *s, dt=jnp.bfloat16: jax.random.normal(next(ks), s, jnp.float32).astype(dt)
        q, k, v = r(1, t, hk, dk), r(1, t, hk, dk), r(1, t, hv, dv)
        a, b = r(1, t, hv), r(1, t, hv)
        a_log, dt_bias = jnp.zeros(hv, jnp.float32), jnp.zeros(hv, jnp.float32)
        pool = jnp.zeros((2, hv, dv, dk), jnp.float32)
        slots, lens, use = jnp.array([1], jnp.int32), jnp.array([t], jnp.int32), jnp.array([False])

        def prog(c):
            def f(q):
                o = None
                for _ in range(c):
                    o, _ = gdn.gdn_prefill(q, k, v, a, b, a_log, dt_bias, pool, slots, lens, use,
                                           interpret=jax.default_backend() != "gpu")
                    q = jax.lax.optimization_barrier(q + 0 * o[..., :dk].astype(q.dtype)[:, :, :hk])
                return o
            return f
        out["prefill_us"] = slope_us(prog, (q,), (2, 6), 5)
    print("RESULT " + json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="the other source tree (the A side; this tree is B)")
    ap.add_argument("--config", default=os.path.join(ROOT, "bench", "configs", "qwen3.5-9b.json"))
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--context", type=int, default=1152)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--prefill-tokens", type=int, default=8192, help="GDN prefill of one sequence (0: none)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                    help="the engines' share of device memory (35B-A3B at 64 rows on an 80 GB card: 0.98)")
    ap.add_argument("--cache", default="/tmp/qwen35-ab-xla", help="persistent XLA cache shared by the rounds")
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--root", default=ROOT, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    trees = {"base": os.path.abspath(args.base), "this": ROOT}
    runs = {name: [] for name in trees}
    for r in range(args.rounds):
        for name in (trees if r % 2 == 0 else list(trees)[::-1]):
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--root", trees[name], "--config",
                   args.config, "--batches", args.batches, "--context", str(args.context), "--iters",
                   str(args.iters), "--prefill-tokens", str(args.prefill_tokens), "--cache", args.cache,
                   "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
            p = subprocess.run(cmd, capture_output=True, text=True, cwd=trees[name],
                               env=dict(os.environ, PYTHONPATH=trees[name]))
            line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
            if p.returncode or line is None:
                sys.exit(f"{name} round {r} failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
            runs[name].append(json.loads(line[7:]))
            print(f"round {r} {name}: {runs[name][-1]}", flush=True)
    rows = []
    keys = [("decode", b) for b in args.batches.split(",") if b]
    keys += [("prefill_us", None)] if args.prefill_tokens else []
    for kind, b in keys:
        get = (lambda run: run["decode"][b]) if kind == "decode" else (lambda run: run["prefill_us"])
        base, this = [get(x) for x in runs["base"]], [get(x) for x in runs["this"]]
        what = f"decode step, batch {b} (ms)" if kind == "decode" else f"GDN prefill 1x{args.prefill_tokens} (us)"
        rows.append({"what": what, "base (median)": f"{statistics.median(base):.3f}",
                     "this (median)": f"{statistics.median(this):.3f}",
                     "this - base, median of rounds": f"{statistics.median(t - s for s, t in zip(base, this)):+.3f}",
                     "all rounds base / this": " ".join(f"{s:.3f}/{t:.3f}" for s, t in zip(base, this))})
        print(rows[-1], flush=True)
    if args.record:
        sys.path.insert(0, ROOT)
        from bench import results
        body = (f"Model `{args.config}` shapes, random bf16 weights, greedy decode at context {args.context}, "
                f"steady-state step (slope of bursts of {args.iters} to {2 * args.iters}); GDN prefill kernel alone "
                f"on one sequence. Base tree `{args.base}`; {args.rounds} rounds of alternating processes; "
                f"gpu_memory_utilization {args.gpu_memory_utilization}.\n\n"
                + results.table(rows, list(rows[0])))
        results.record("Commit A/B (bench/ab_commit.py)", body)


if __name__ == "__main__":
    main()

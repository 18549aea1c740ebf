"""Multi-turn chat with and without the prefix cache: one engine, the same conversations, the same run.

Token-id conversations (no tokenizer needed): every conversation opens with the same system prompt, then each turn
adds a user message of random tokens and the model's answer (max tokens, ignore_eos), so turn t + 1's prompt is
turn t's prompt, its answer and a new user message. `--concurrency` conversations run at once, each turn by turn,
pausing `--think-ms` (exponential, mean; seeded, the same in every phase) between a turn's answer and the next
message: without a pause, conversations whose answers all have the same length stay in lockstep and every turn
boundary is a burst of `--concurrency` prompts at once.
Reported per phase: time to first token (p50 / p99) of first turns and of later turns, prompt tokens prefilled,
tokens found in the cache, output tokens per second. Then a no-reuse workload (random prompts) with the cache on
and off, alternating. "Off" is the same engine with its prefix cache's lookups and snapshots switched off (what
`enable_prefix_caching=False` runs, minus the snapshot pool's memory): same executables, same pages. Each phase
starts with an empty cache. `--snapshots N ...` repeats the multi-turn phase with the snapshot pool limited to N
entries: the memory / hit-rate trade-off.

    python bench/multiturn.py --config bench/configs/qwen3.5-9b.json --record        # H200, random weights
    python bench/multiturn.py --system-len 512 --conversations 8                     # the default model, CPU
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import results  # noqa: E402
from bench.common import random_engine  # noqa: E402
from qwen35_jax.engine.engine import EngineArgs, build_engine  # noqa: E402
from qwen35_jax.engine.sampling_params import SamplingParams  # noqa: E402
from qwen35_jax.model.hub import default_model_dir  # noqa: E402
from qwen35_jax.model.state import bytes_per_slot  # noqa: E402


def set_cache(engine, on: bool, snapshots: int | None = None):
    """Empty the prefix cache; switch it on or off; optionally limit its snapshot pool to `snapshots` entries."""
    for pool in engine.scheduler.pools:
        cache = pool.cache
        assert cache.reset(), "a restore is pending between phases"
        n = snapshots if snapshots is not None else engine.num_snapshots
        cache.free_entries = list(range(min(n, engine.num_snapshots), 0, -1))
        cache.enabled = on


async def one(engine, prompt: list[int], params: SamplingParams, stats: list, turn: int):
    final = None
    async for out in engine.generate_async({"prompt_token_ids": prompt}, params):
        final = out
    m = final.metrics
    stats.append({"turn": turn, "ttft": m["first_token_time"] - m["arrival_time"], "cached": final.num_cached_tokens,
                  "prompt": len(prompt), "output": len(final.outputs[0].token_ids)})
    return final.outputs[0].token_ids


async def conversations(engine, args, rng) -> list[dict]:
    vocab = engine.cfg.vocab_size
    system = rng.integers(0, vocab, args.system_len).tolist()
    users = [[rng.integers(0, vocab, args.user_len).tolist() for _ in range(args.turns)]
             for _ in range(args.conversations)]
    params = SamplingParams(max_tokens=args.answer_len, temperature=0, ignore_eos=True)
    pauses = rng.exponential(args.think_ms / 1e3, (args.conversations, args.turns)) if args.think_ms else \
        np.zeros((args.conversations, args.turns))
    gate, stats = asyncio.Semaphore(args.concurrency), []

    async def talk(c):
        async with gate:
            history = list(system)
            for t in range(args.turns):
                if t:
                    await asyncio.sleep(pauses[c, t])
                history += users[c][t]
                history += await one(engine, history, params, stats, t)
    await asyncio.gather(*(talk(c) for c in range(args.conversations)))
    return stats


async def no_reuse(engine, args, rng) -> list[dict]:
    params = SamplingParams(max_tokens=args.answer_len, temperature=0, ignore_eos=True)
    gate, stats = asyncio.Semaphore(args.concurrency), []
    prompts = [rng.integers(0, engine.cfg.vocab_size, args.random_len).tolist() for _ in range(args.random_requests)]

    async def go(p):
        async with gate:
            await one(engine, p, params, stats, 0)
    await asyncio.gather(*(go(p) for p in prompts))
    return stats


def phase(engine, name: str, workload, args, on: bool, snapshots: int | None = None) -> dict:
    set_cache(engine, on, snapshots)
    rng = np.random.default_rng(args.seed)          # the same tokens in every phase
    s = engine.scheduler
    before = (engine.stats.prompt_tokens, s.prefix_queries, s.prefix_hits)
    t0 = time.perf_counter()
    stats = asyncio.run(workload(engine, args, rng))
    wall = time.perf_counter() - t0
    pct = lambda xs, q: float(np.percentile(xs, q)) * 1e3 if xs else float("nan")
    first = [r["ttft"] for r in stats if r["turn"] == 0]
    later = [r["ttft"] for r in stats if r["turn"] > 0]
    row = {"phase": name, "cache": "on" if on else "off", "snapshots": snapshots or (engine.num_snapshots if on else 0),
           "requests": len(stats), "ttft_first_p50_ms": pct(first, 50), "ttft_first_p99_ms": pct(first, 99),
           "ttft_later_p50_ms": pct(later, 50), "ttft_later_p99_ms": pct(later, 99),
           "prompt_tokens": sum(r["prompt"] for r in stats),
           "prefilled_tokens": engine.stats.prompt_tokens - before[0],
           "cached_tokens": sum(r["cached"] for r in stats), "hit_rate": (s.prefix_hits - before[2]) /
           max(1, s.prefix_queries - before[1]), "output_tok_s": sum(r["output"] for r in stats) / wall,
           "wall_s": wall}
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="config.json at real shapes, random weights (default: the default model)")
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-len", type=int, default=2048)
    ap.add_argument("--user-len", type=int, default=100)
    ap.add_argument("--answer-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--think-ms", type=float, default=0.0, help="mean pause between turns (exponential)")
    ap.add_argument("--random-requests", type=int, default=64, help="no-reuse workload: requests per phase")
    ap.add_argument("--random-len", type=int, default=2148, help="no-reuse workload: prompt tokens")
    ap.add_argument("--rounds", type=int, default=2, help="no-reuse workload: on / off pairs")
    ap.add_argument("--snapshots", type=int, nargs="*", default=[], help="pool sizes of the trade-off sweep")
    ap.add_argument("--num-state-snapshots", type=int, default=None, help="the engine's pool (default: auto)")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-prefill-rows", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--compilation-cache-dir", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    longest = args.system_len + args.turns * (args.user_len + args.answer_len)
    eargs = EngineArgs(dtype=args.dtype, max_model_len=max(longest, args.random_len + args.answer_len) + 16,
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       max_prefill_rows=args.max_prefill_rows, num_state_snapshots=args.num_state_snapshots,
                       compilation_cache_dir=args.compilation_cache_dir)
    t0 = time.perf_counter()
    engine = random_engine(args.config, eargs) if args.config else build_engine(default_model_dir(), eargs)
    print(f"engine ready in {time.perf_counter() - t0:.0f}s: {engine.num_snapshots} snapshots of "
          f"{bytes_per_slot(engine.cfg, engine.dtype) / 2**20:.1f} MiB, {engine.scheduler.num_pages} KV pages",
          flush=True)
    warm = argparse.Namespace(**{**vars(args), "conversations": 2, "turns": 2, "random_requests": 2})
    phase(engine, "warm-up", conversations, warm, True)     # first dispatches of each kind, off the record
    rows = [phase(engine, "multi-turn", conversations, args, False),
            phase(engine, "multi-turn", conversations, args, True)]
    for n in args.snapshots:
        rows.append(phase(engine, "multi-turn", conversations, args, True, n))
    for r in range(args.rounds):
        for on in (r % 2 == 0, r % 2 == 1):
            rows.append(phase(engine, "no-reuse", no_reuse, args, on))
    engine.shutdown()
    off, on = rows[0], rows[1]
    summary = {"ttft_later_p50_speedup": off["ttft_later_p50_ms"] / on["ttft_later_p50_ms"],
               "no_reuse_output_tok_s_on_over_off": np.mean([r["output_tok_s"] for r in rows
                                                             if r["phase"] == "no-reuse" and r["cache"] == "on"]) /
               np.mean([r["output_tok_s"] for r in rows if r["phase"] == "no-reuse" and r["cache"] == "off"]),
               "no_reuse_ttft_p50_on_over_off": np.mean([r["ttft_first_p50_ms"] for r in rows
                                                         if r["phase"] == "no-reuse" and r["cache"] == "on"]) /
               np.mean([r["ttft_first_p50_ms"] for r in rows if r["phase"] == "no-reuse" and r["cache"] == "off"]),
               "snapshot_mib": bytes_per_slot(engine.cfg, engine.dtype) / 2**20}
    print(summary)
    cols = ["phase", "cache", "snapshots", "requests", "ttft_first_p50_ms", "ttft_first_p99_ms", "ttft_later_p50_ms",
            "ttft_later_p99_ms", "prefilled_tokens", "cached_tokens", "hit_rate", "output_tok_s"]
    body = results.table([{k: f"{v:.3f}" if isinstance(v, float) else v for k, v in r.items()} for r in rows], cols)
    body += "\n\n" + ", ".join(f"{k} {v:.3f}" for k, v in summary.items())
    print(body)
    if args.record:
        results.record("Multi-turn chat with and without the prefix cache (bench/multiturn.py)", body,
                       fields={"args": vars(args), "rows": rows, "summary": summary})


if __name__ == "__main__":
    main()

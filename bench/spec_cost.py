"""The cost side of speculative decoding at real shapes: the decode step with k MTP drafts against a plain one.

    python bench/spec_cost.py --config bench/configs/qwen3.5-9b.json [--k 3] [--batches 1 16 64] [--record]

Random weights at the config's shapes, with an MTP head (mtp_num_hidden_layers = 1, as Qwen3.5's checkpoints
declare it). Random drafts are almost never accepted, so each speculative step here costs what any step costs:
verify k + 1 tokens, commit, draft k. Both steps are measured through `Engine.generate`, each as the slope between
a long and a short generate of `rows` token-id prompts (the prefill phase cancels), with the same weights. From the
two step times the decode tokens per second at an accept length L (mean tokens a row gains per step) is
L / spec step against 1 / plain step. The `--accept-lengths` are the figures to project at: Qwen3.5's published
MTP accept lengths (../shared/reference/serving-anchors.md) and the default model's own
(bench/RESULTS.md, "Speculative decoding"). Each is labelled as what it is.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))     # the repo, not bench/
from bench import results  # noqa: E402
from bench.common import add_kernel_args, kernel_config, random_engine  # noqa: E402
from qwen35_jax.engine.engine import EngineArgs  # noqa: E402
from qwen35_jax.engine.sampling_params import SamplingParams  # noqa: E402

ACCEPT_LENGTHS = {"published k=3, SGLang 397B batch 1": 3.12, "published k=3, small models": 2.7,
                  "default model k=3, greedy (CPU)": 2.166}


def with_mtp(config: str) -> dict:
    raw = json.load(open(config))
    text = raw.get("text_config", raw)
    text.update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    return raw


def step_ms(engine, rows: int, prompt: int, long: int, short: int, vocab: int, rounds: int) -> tuple[float, float]:
    """(ms per decode step, tokens a row gains per step): the median over rounds of the slope between a long and a
    short generate."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, prompt).tolist() for _ in range(rows)]
    st = engine.stats

    def run(tokens):
        steps, t0 = st.steps, time.perf_counter()
        engine.generate(prompts, [SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)] * rows, False)
        return time.perf_counter() - t0, st.steps - steps

    run(short)                                                    # compiles the buckets it uses
    slopes, verified, accepted = [], st.spec_steps, int(st.spec_accepted.sum())
    for _ in range(rounds):
        (wl, sl), (ws, ss) = run(long), run(short)
        slopes.append(1e3 * (wl - ws) / (sl - ss))
    rows_steps = st.spec_steps - verified
    gained = 1 + (int(st.spec_accepted.sum()) - accepted) / rows_steps if rows_steps else 1.0
    return float(np.median(slopes)), gained


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens per row")
    ap.add_argument("--tokens", type=int, default=160, help="the long generate's tokens per row")
    ap.add_argument("--short", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--record", action="store_true")
    add_kernel_args(ap)
    args = ap.parse_args()
    raw = with_mtp(args.config)
    base = EngineArgs(max_model_len=args.prompt + args.tokens + 64, max_num_seqs=max(args.batches),
                      max_num_batched_tokens=max(1024, args.prompt), max_prefill_rows=1, dtype=args.dtype,
                      kernel_config=kernel_config(args), precompile=False, enable_prefix_caching=False,
                      num_kv_pages=1 + max(args.batches) * (-(-(args.prompt + args.tokens + 64 + 2 * args.k) // 16)))
    spec = random_engine(raw, dataclasses.replace(base, speculative_config={"method": "mtp",
                                                                            "num_speculative_tokens": args.k}))
    plain = random_engine(raw, base, weights=dataclasses.replace(spec.weights, mtp=None))
    vocab = spec.cfg.vocab_size
    rows = []
    for b in args.batches:
        p_ms, _ = step_ms(plain, b, args.prompt, args.tokens, args.short, vocab, args.rounds)
        s_ms, gained = step_ms(spec, b, args.prompt, args.tokens, args.short, vocab, args.rounds)
        row = {"batch": b, "plain_step_ms": p_ms, "spec_step_ms": s_ms, "spec_over_plain": s_ms / p_ms,
               "tokens_per_step_here": gained}
        row.update({f"tok_s_ratio_at_{L}": L * p_ms / s_ms for L in ACCEPT_LENGTHS.values()})
        print(row, flush=True)
        rows.append(row)
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else v
    body = (f"Model `{os.path.basename(args.config)}` shapes with an MTP head, random {args.dtype} weights, "
            f"k = {args.k}, prompts of {args.prompt} tokens, greedy; steps are slopes between generates of "
            f"{args.tokens} and {args.short} tokens (median of {args.rounds}). tok_s_ratio_at_L: decode tokens/s "
            f"with speculation at accept length L over plain decoding, L from: "
            + "; ".join(f"{v} = {k}" for k, v in ACCEPT_LENGTHS.items()) + ".\n\n"
            + results.table([{c: fmt(v) for c, v in r.items()} for r in rows], list(rows[0])))
    print(body)
    if args.record:
        results.record("Speculative decoding: step cost at real shapes (bench/spec_cost.py)", body,
                       fields={"args": vars(args), "results": rows})


if __name__ == "__main__":
    main()

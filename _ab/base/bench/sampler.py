"""Decode sampler on the GPU: the whole sampling pass and its parts, per call, at the 9B vocabulary.

    python bench/sampler.py --record [--old path/to/older/sampler.py]
    python bench/sampler.py --batches 2 --vocab 4096          # CPU smoke run of the script itself

Times `sampler.sample` (candidates and full-vocabulary executables) as the engine's decode step runs it (penalty
rows gathered from the slot pool, T=0.7 top_p=0.8 top_k=20 with logprobs), its parts, and with --old the
`sample` of another sampler module (e.g. an earlier commit's, saved by `git show`) with the log-softmax rank the
executor then computed, side by side in one run. GPU time, host dispatch excluded (see per_call_us).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import results  # noqa: E402
from bench.timing import slope_us  # noqa: E402
from qwen35_jax.engine import sampler  # noqa: E402


def per_call_us(fn, logits, extra, calls=(2, 8), reps=7):
    """fn(logits, extra) -> int32 [B]; microseconds per call: straight-line programs of c calls (each call's tokens
    written into the next call's logits, so nothing is shared or hoisted), for two c; per call = slope. `extra`
    (the penalty pools) goes in as an argument: closed over, XLA would constant-fold its gathers at compile time."""
    def make_prog(c):
        def prog(x, extra):
            for _ in range(c):
                x = x.at[:, 0].set(fn(x, extra).astype(x.dtype) * 1e-9)
            return x
        return prog
    return slope_us(make_prog, (logits, extra), calls, reps)


def params(b):
    return sampler.SamplingBatch(
        temperature=jnp.full((b,), 0.7), top_k=jnp.full((b,), 20, jnp.int32), top_p=jnp.full((b,), 0.8),
        min_p=jnp.zeros((b,)), presence=jnp.zeros((b,)), frequency=jnp.zeros((b,)), repetition=jnp.ones((b,)),
        seed=jnp.arange(b, dtype=jnp.uint32), step=jnp.zeros((b,), jnp.int32), logprobs=jnp.ones((b,), bool))


def pools(b, v):
    """Penalty pools of b + 1 slots (generated-token counts, prompt mask), some tokens set in every live slot."""
    return (jnp.zeros((b + 1, v), jnp.int32).at[1:, :64].set(1), jnp.zeros((b + 1, v), bool).at[1:, 64:1000].set(True))


def variants(b, v, old):
    """name -> fn(logits, (counts pool, mask pool)) -> int32 [B]."""
    p = params(b)
    slots = jnp.arange(1, b + 1, dtype=jnp.int32)

    def engine(sample):
        return lambda x, pools: sample(x, p, pools[0][slots], pools[1][slots])

    out = {
        "sample": engine(lambda *a: sampler.sample(*a, full_vocab=False)[0]),
        "sample full vocab": engine(lambda *a: sampler.sample(*a, full_vocab=True)[0]),
        "sample lean": engine(lambda *a: sampler.sample(*a, full_vocab=False, extras=False)[0]),
        "penalties (argmax)": engine(lambda x, _, c, m: jnp.argmax(sampler.apply_penalties(x, p, c, m), -1)),
        "log-sum-exp": lambda x, _: jax.nn.logsumexp(x, -1).astype(jnp.int32),
        "top 128 (16,8,8)": lambda x, _: sampler.top_k_desc(x, 128)[1][:, -1],
        "top 128 (16,8)": lambda x, _: sampler.top_k_desc(x, 128, blocks=(16, 8))[1][:, -1],
        "top 128 (16,16,8)": lambda x, _: sampler.top_k_desc(x, 128, blocks=(16, 16, 8))[1][:, -1],
        "top 128 (128)": lambda x, _: sampler.top_k_desc(x, 128, blocks=(128,))[1][:, -1],
        "top 20 (16,8,8)": lambda x, _: sampler.top_k_desc(x, 20)[1][:, -1],
        "top 20 (16,8)": lambda x, _: sampler.top_k_desc(x, 20, blocks=(16, 8))[1][:, -1],
        "top 20 (16,16,8)": lambda x, _: sampler.top_k_desc(x, 20, blocks=(16, 16, 8))[1][:, -1],
        "top 128 (lax.top_k)": lambda x, _: jax.lax.top_k(x, 128)[1][:, -1],
        "draw": lambda x, _: sampler.draw(x, x[:, :1], x.max(-1, keepdims=True), jnp.full((b, 2), 0.5)),
        "gumbel argmax": lambda x, _: jnp.argmax(x + jax.random.gumbel(jax.random.key(0), x.shape), -1),
    }
    if old is not None:
        def old_sample(x, pools):
            tok, lp = old.sample(x, p, pools[0][slots], pools[1][slots], full_vocab=False)
            raw = jax.nn.log_softmax(x, axis=-1)
            rank = jnp.sum(raw > lp["logprob"][:, None], axis=-1)
            return tok + (rank < 0)
        out = {"old sample": old_sample, **out}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--old", help="another sampler module's file to time beside this one")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    old = None
    if args.old:
        spec = importlib.util.spec_from_file_location("old_sampler", args.old)
        old = sys.modules["old_sampler"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    batches = [int(b) for b in args.batches.split(",")]
    table = {}
    for b in batches:
        logits = jax.random.normal(jax.random.key(b), (b, args.vocab), jnp.float32) * 3
        extra = pools(b, args.vocab)
        for name, fn in variants(b, args.vocab, old).items():
            table.setdefault(name, {})[b] = per_call_us(fn, logits, extra)
            print(f"batch {b:3d} {name:24s} {table[name][b]:8.1f} us", flush=True)
    lines = ["| part | " + " | ".join(f"batch {b} us" for b in batches) + " |",
             "|---|" + "---|" * len(batches)]
    lines += [f"| {name} | " + " | ".join(f"{t[b]:.1f}" for b in batches) + " |" for name, t in table.items()]
    body = (f"Vocabulary {args.vocab}, fp32 logits, T=0.7 top_p=0.8 top_k=20 with logprobs. 'sample': the decode "
            "step's sampling pass (candidates executable, with penalties and logprobs; 'sample lean': without, the "
            "executable of batches that ask for neither); the rows below it are its parts alone"
            + (f"; 'old sample': `{args.old}` with the executor's log-softmax rank" if old else "") + ".\n\n"
            + "\n".join(lines) + "\n")
    print(body)
    if args.record:
        results.record("Decode sampler (bench/sampler.py)", body)


if __name__ == "__main__":
    main()

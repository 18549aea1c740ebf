"""The prefill executable's lm_head against the decode step's, and forms of it, one process, device time per call.

A 9B prefill of 8192 tokens spent 3.5 ms in its head (XLA converted the whole bf16 head to fp32 and ran a cuBLAS
gemv), where the decode step ran the same [1, H] x [H, V] product as a Triton fusion in 0.66 ms (bench/RESULTS.md,
issue 39). Forms timed, each from the decoder's output [1, T, H] (pre-norm) to fp32 logits [1, V]:
- decode: T = 1 (the decode step's shape)
- norm_gather: the final norm over all T positions, then the last one, then the head (the prefill executable)
- gather_norm: the last position first, then its norm and the head
- barrier: gather_norm with an optimization barrier before the dot (no producer fused into the GEMM)

    python bench/lm_head.py --config bench/configs/qwen3.5-9b.json --tokens 8192 --record
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench import results  # noqa: E402
from bench.common import config_dir  # noqa: E402
from bench.timing import slope_us  # noqa: E402
from qwen35_jax.model.config import load_config  # noqa: E402
from qwen35_jax.model.forward import last_real, rms_norm_1p  # noqa: E402


def forms(eps):
    def head(x, w):
        return jnp.dot(x, w, preferred_element_type=jnp.float32)

    return {
        "decode": lambda x, n, w, lens: head(rms_norm_1p(x[:, -1], n, eps), w),
        "norm_gather": lambda x, n, w, lens: head(last_real(rms_norm_1p(x, n, eps), lens), w),
        "gather_norm": lambda x, n, w, lens: head(rms_norm_1p(last_real(x, lens), n, eps), w),
        "barrier": lambda x, n, w, lens: head(jax.lax.optimization_barrier(rms_norm_1p(last_real(x, lens), n, eps)),
                                              w),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--calls", default="2,8")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    cfg = load_config(config_dir(args.config))
    h, v, bf = cfg.hidden_size, cfg.vocab_size, jnp.bfloat16
    keys = jax.random.split(jax.random.key(0), 3)
    w = (jax.random.normal(keys[0], (h, v), jnp.float32) * 0.02).astype(bf)
    norm = (jax.random.normal(keys[1], (h,), jnp.float32) * 0.1).astype(bf)
    lens = jnp.array([args.tokens], jnp.int32)
    calls = tuple(int(c) for c in args.calls.split(","))
    rows = []
    for name, f in forms(cfg.rms_norm_eps).items():
        t = 1 if name == "decode" else args.tokens
        x = jax.random.normal(keys[2], (1, t, h), jnp.float32).astype(bf)

        def make(c, f=f):
            def prog(x, n, w, lens):
                acc = jnp.zeros((1, v), jnp.float32)
                for i in range(c):        # each call's input depends on the last one's output: none is shared
                    acc = acc + f(x + acc[:, :1, None].astype(bf) * 0, n, w, lens)
                return acc
            return prog

        us = slope_us(make, (x, norm, w, lens), calls)
        rows.append({"form": name, "tokens": t, "us": us, "gb_per_s": h * v * 2 / us / 1e3})
        print(json.dumps(rows[-1]), flush=True)
    body = (f"Model `{os.path.basename(args.config)}` head [{h}, {v}] bf16, fp32 logits of one row; device time per "
            f"call (slope over {calls[0]} and {calls[1]} calls in one program).\n\n"
            + results.table([{k: f"{x:.1f}" if isinstance(x, float) else x for k, x in r.items()} for r in rows],
                            list(rows[0])))
    print(body)
    if args.record:
        results.record("Prefill lm_head forms (bench/lm_head.py)", body, fields={"rows": rows, "args": vars(args)})


if __name__ == "__main__":
    main()

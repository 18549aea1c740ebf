"""Held-out perplexity of the default model through the engine (prompt logprobs), against the training script's.

    python bench/perplexity.py [--model DIR] [--dtype float32] [--windows N] [--record]

The held-out set is the trained model's own (`heldout.jsonl` beside the checkpoint, cut into the windows
tools/train_tiny scores: `heldout_windows`). Each window goes to `LLM.generate` as a prompt with
`prompt_logprobs=0`; the perplexity is exp of the mean negative logprob of tokens 1..W-1. The same windows are
scored by the training script's evaluation (`train_tiny.evaluate`, the project's forward on the checkpoint as
written, no engine), which also gives the MTP head's top-1 accuracy; training_log.json holds the figure recorded
at training time.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model trained by tools/train_tiny (default: the default model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--windows", type=int, default=0, help="score the first N windows (default: all)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()

    import jax.numpy as jnp
    from tokenizers import Tokenizer

    from qwen35_jax import LLM, SamplingParams
    from qwen35_jax.model.config import load_config
    from qwen35_jax.model.sharding import make_mesh
    from qwen35_jax.model.weights import load_weights
    from qwen35_jax.tools import train_tiny
    from qwen35_jax.model.hub import default_model_dir

    model = args.model or default_model_dir()
    with open(os.path.join(model, "training_log.json")) as f:
        trained = json.load(f)
    seq_len = trained["train_config"]["seq_len"]
    tok = Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
    windows = train_tiny.heldout_windows(tok, os.path.join(model, "heldout.jsonl"), seq_len,
                                         tok.token_to_id("<|endoftext|>"))
    if args.windows:
        windows = windows[:args.windows]
    n, w = windows.shape

    llm = LLM(model, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size, max_model_len=2 * seq_len,
              max_num_seqs=16, max_num_batched_tokens=4 * seq_len, max_prefill_rows=4)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": [int(t) for t in row]} for row in windows],
                        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    engine_s = time.perf_counter() - t0
    nll = 0.0
    for row, out in zip(windows, outs):
        lps = out.prompt_logprobs
        assert lps[0] is None and len(lps) == w
        nll -= sum(lps[i][int(row[i])].logprob for i in range(1, w))
    engine_nll = nll / (n * (w - 1))
    llm.engine.shutdown()

    cfg = load_config(model)
    weights = load_weights(model, cfg, make_mesh(1), jnp.float32, mtp=True)
    ref = train_tiny.evaluate(cfg, weights, windows, trained["train_config"]["page_size"])
    rows = [dict(what="engine, prompt logprobs", dtype=args.dtype, nll=f"{engine_nll:.5f}",
                 perplexity=f"{np.exp(engine_nll):.4f}"),
            dict(what="training script's evaluate()", dtype="float32", nll=f"{ref['nll']:.5f}",
                 perplexity=f"{ref['perplexity']:.4f}")]
    if not args.windows:
        rows.append(dict(what="training_log.json (at training time)", dtype="float32",
                         nll=f"{trained['heldout']['nll']:.5f}", perplexity=f"{trained['heldout']['perplexity']:.4f}"))
    ratio = float(np.exp(engine_nll) / ref["perplexity"])
    for r in rows:
        print(r)
    print(f"engine / training-script perplexity: {ratio:.5f}; top-1 {ref['top1']:.4f}; MTP top-1 (t+2 given the "
          f"true t+1) {ref['mtp_top1']:.4f}; {n} windows of {w} tokens; engine {engine_s:.1f}s")
    if args.record:
        from bench import results
        body = (f"Model `{os.path.basename(os.path.normpath(model))}` ({trained['description']}). Held-out set: "
                f"{n} windows of {w} tokens from heldout.jsonl; perplexity over tokens 1..{w - 1} of each window.\n\n"
                + results.table(rows, list(rows[0]))
                + f"\n\nEngine / training-script perplexity {ratio:.5f}. Top-1 (main head) {ref['top1']:.4f}; MTP head "
                  f"top-1 (token t+2 given the true t+1) {ref['mtp_top1']:.4f}.")
        results.record("Held-out perplexity and MTP accuracy of the default model (bench/perplexity.py)", body,
                       fields=dict(engine_nll=engine_nll, reference=ref, ratio=ratio, dtype=args.dtype))


if __name__ == "__main__":
    main()

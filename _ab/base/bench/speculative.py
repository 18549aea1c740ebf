"""Speculative decoding with the MTP head: acceptance on held-out text and end-to-end generate time, k = 1..4.

    python bench/speculative.py [--model DIR] [--k 1 2 3 4] [--temperatures 0 1] [--docs N] [--record]

Prompts are the first --prompt-tokens tokens of each held-out document of the trained default model
(`heldout.jsonl` beside its checkpoint: text it never trained on); each generates --max-tokens tokens. For each k
the engine's counters give the acceptance rate of each draft position (accepted / row-steps verified) and the mean
tokens a row gains per step (1 + accepted drafts per row-step). The wall clock of the same `LLM.generate` without
drafts, in the same process, gives the end-to-end ratio. On the CPU machine that ratio says little about a GPU:
the acceptance rates are the transferable part.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0] = ROOT           # the repo, not bench/ (whose profile.py would shadow the standard library's)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model with an MTP head (default: the default model)")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--docs", type=int, default=16, help="held-out documents used as prompts")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()

    from bench import results
    from qwen35_jax import LLM, SamplingParams
    from qwen35_jax.model.hub import default_model_dir
    model = args.model or default_model_dir()
    with open(os.path.join(model, "heldout.jsonl")) as f:
        docs = [json.loads(line)["text"] for line in f][:args.docs]
    engine = dict(max_num_seqs=len(docs), max_model_len=args.prompt_tokens + args.max_tokens + 16, dtype=args.dtype,
                  max_num_batched_tokens=max(256, args.prompt_tokens),
                  # every bucket compiled up front: which buckets a generate passes through varies run to run (when
                  # each request joins the batch), so a warm-up generate does not compile them all
                  precompile=True,
                  enable_prefix_caching=False)      # the timed generate repeats the warm-up's prompts
    rows = []

    def run(llm, temperature):
        tok = llm.engine.tokenizer
        prompts = [tok.encode(d)[:args.prompt_tokens] for d in docs]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature, seed=0, ignore_eos=True)
        llm.generate(prompts, params)          # the same generate once untimed
        compiled = len(llm.engine.executor.compiled)
        st = llm.engine.stats
        steps, accepted = st.spec_steps, st.spec_accepted.copy()
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        assert len(llm.engine.executor.compiled) == compiled, "the timed generate compiled an executable"
        steps = st.spec_steps - steps
        return wall, steps, st.spec_accepted - accepted

    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else v

    def flush():            # after each k: a run cut short by its time limit keeps the rows it finished
        body = (f"Model `{os.path.basename(model.rstrip('/'))}` ({args.dtype}), {len(docs)} held-out documents as "
                f"prompts of {args.prompt_tokens} tokens, {args.max_tokens} tokens each (ignore_eos, seed 0); greedy "
                f"drafts from the MTP head; speedup = plain / speculative wall time of the same generate.\n\n"
                + results.table([{c: fmt(v) for c, v in r.items()} for r in rows], list(rows[0])))
        print(body, flush=True)
        if args.record:
            results.record("Speculative decoding with the MTP head (bench/speculative.py)", body,
                           fields={"args": vars(args), "results": rows})

    with LLM(model, **engine) as llm:
        plain = {t: run(llm, t)[0] for t in args.temperatures}
    for k in args.k:
        with LLM(model, speculative_config={"method": "mtp", "num_speculative_tokens": k}, **engine) as llm:
            for t in args.temperatures:
                wall, steps, accepted = run(llm, t)
                rate = accepted / max(steps, 1)
                row = {"k": k, "temperature": t, "acceptance_per_position": " / ".join(f"{r:.3f}" for r in rate),
                       "mean_tokens_per_step": 1 + float(rate.sum()), "row_steps": steps,
                       "generate_s": wall, "plain_generate_s": plain[t], "speedup": plain[t] / wall}
                print(row, flush=True)
                rows.append(row)
        flush()
    return np.mean([r["mean_tokens_per_step"] for r in rows])


if __name__ == "__main__":
    main()

"""HF transformers + fla against this engine in one run on one GPU: the prefill of one long prompt (its time to
first token), at real shapes with random bf16 weights.

HF runs first, in a child process of its own (torch and JAX do not share the GPU's memory well): the model made
from the config (`AutoModelForCausalLM.from_config`, fla's Gated DeltaNet kernels where transformers finds fla),
one forward of the prompt with `logits_to_keep=1` (the logits a first token needs), median of --reps after a
warm-up. Then this engine: one request of the same length with max_tokens=1 through `Engine.generate` (chunked
prefill at --max-num-batched-tokens per step, then the first token sampled), median of --reps after a warm-up
that compiles its buckets.

    python bench/hf_baseline.py --config bench/configs/qwen3.5-9b.json --prompt-lens 8192,32768 --record
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hf_child(args):
    """In a process of its own: {prompt length: [seconds per forward, ...]} for HF transformers on cuda."""
    here = os.path.dirname(os.path.abspath(__file__))       # bench/kernels.py would shadow HF's `kernels` package
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import import_utils
    raw = json.load(open(args.config))
    config = AutoConfig.for_model(**raw)
    torch.manual_seed(0)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16).eval()
    fla = getattr(import_utils, "is_flash_linear_attention_available", lambda: None)()
    out = {"fla": fla, "torch": torch.__version__, "times": {}}
    vocab = raw.get("text_config", raw)["vocab_size"]
    for n in [int(x) for x in args.prompt_lens.split(",")]:
        ids = torch.randint(0, vocab, (1, n), device=args.device)
        times = []
        with torch.inference_mode():
            for i in range(args.reps + 1):
                sync()
                t0 = time.perf_counter()
                model(input_ids=ids, logits_to_keep=1)
                sync()
                if i:                                   # the first forward is the warm-up
                    times.append(time.perf_counter() - t0)
        out["times"][n] = times
        print(f"HF {n} tokens: {[round(t * 1e3, 1) for t in times]} ms", file=sys.stderr, flush=True)
    print("RESULT " + json.dumps(out), flush=True)


def run_hf(config: str, prompt_lens: str, reps: int, device: str = "cuda") -> dict | None:
    """hf_child in a process of its own: {"fla", "torch", "times": {length: [seconds, ...]}}, or None (printed
    why) if it failed, e.g. out of memory at a long prompt."""
    cmd = [sys.executable, os.path.abspath(__file__), "--hf-child", "--config", config, "--prompt-lens",
           prompt_lens, "--reps", str(reps), "--device", device]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if p.returncode or line is None:
        print(f"the HF run failed (exit {p.returncode}):\n{p.stdout[-3000:]}", flush=True)
        return None
    return json.loads(line[7:])


def ours(args) -> dict:
    """{prompt length: [seconds to the first token, ...]} through this engine."""
    sys.path.insert(0, ROOT)
    import numpy as np

    from bench.common import kernel_config, random_engine
    from qwen35_jax.engine.engine import EngineArgs
    from qwen35_jax.engine.sampling_params import SamplingParams
    lens = [int(x) for x in args.prompt_lens.split(",")]
    engine = random_engine(args.config, EngineArgs(
        max_model_len=max(lens) + 16, max_num_seqs=1, max_num_batched_tokens=args.max_num_batched_tokens,
        max_prefill_rows=1, precompile=False, kernel_config=kernel_config(args)))
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    rng = np.random.default_rng(0)
    out = {}
    for n in lens:
        prompt = rng.integers(0, engine.cfg.vocab_size, n).tolist()
        times = []
        for i in range(args.reps + 1):
            t0 = time.perf_counter()
            engine.generate([prompt], [params])
            if i:
                times.append(time.perf_counter() - t0)
        out[n] = times
        print(f"ours {n} tokens: {[round(t * 1e3, 1) for t in times]} ms", flush=True)
    engine.shutdown()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(ROOT, "bench", "configs", "qwen3.5-9b.json"))
    ap.add_argument("--prompt-lens", default="8192,32768")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--hf-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)     # the HF child's (cpu: a smoke run)
    ap.add_argument("--kernel-backend", default=None)
    ap.add_argument("--kernel-config", default="")
    args = ap.parse_args()
    if args.hf_child:                   # torch only: this process must not import JAX
        return hf_child(args)
    hf = run_hf(args.config, args.prompt_lens, args.reps, args.device)
    if hf is None:
        sys.exit("the HF run failed")
    mine = ours(args)
    rows = []
    for n in mine:
        h, o = statistics.median(hf["times"][str(n)]), statistics.median(mine[n])
        rows.append({"prompt tokens": n, "HF + fla ms": f"{h * 1e3:.1f}", "qwen35_jax ms": f"{o * 1e3:.1f}",
                     "HF / ours": f"{h / o:.2f}"})
        print(rows[-1], flush=True)
    if args.record:
        from bench import results
        body = (f"Model `{args.config}` shapes, random bf16 weights, one prompt, one GPU. HF transformers (torch "
                f"{hf['torch']}, fla available: {hf['fla']}): one forward with logits_to_keep=1. qwen35_jax: "
                f"time to the first token of one request (max_tokens=1, prefill chunks of "
                f"{args.max_num_batched_tokens} tokens). Median of {args.reps} after a warm-up each.\n\n"
                + results.table(rows, list(rows[0])))
        results.record("Prefill against HF transformers + fla (bench/hf_baseline.py)", body,
                       fields={"hf": hf["times"], "ours": mine})


if __name__ == "__main__":
    main()

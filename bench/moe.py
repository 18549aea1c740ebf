"""Qwen3.5-MoE decode (issue 40) at real shapes with random weights, against its floor and HF transformers.

Decode step at each --batches size (context --context, steady-state slope of back-to-back dispatches,
bench/throughput.py's time_decode) against its floor: the bytes a step must read (the non-expert weights, the
experts it routes to, GDN state read and written, K/V read) over the copy bandwidth measured in the same run.
Routed experts per layer are counted on the step's own inputs (rows fed distinct random tokens, an
engine of its own that reports each layer's routing), beside the expectation under uniform routing,
E (1 - (1 - k/E)^b) for b rows. HF transformers runs first in a child process of its own:
`generate` of --hf-tokens tokens at every batch, greedy, tokens/s. --ttft: then the time to the first token of one
prompt of each length (random ids, chunks of 2048 tokens, median of 3 after a warm-up that compiles the buckets),
beside the prefill's expert-weight floor (every expert's weights read once per chunk, over the copy bandwidth).

    python bench/moe.py --config bench/configs/qwen3.5-35b-a3b.json --record
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ints = lambda text: [int(x) for x in text.split(",") if x]


def hf_child(args):
    here = os.path.dirname(os.path.abspath(__file__))       # bench/kernels.py would shadow HF's `kernels` package
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    raw = json.load(open(args.config))
    torch.manual_seed(0)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw), torch_dtype=torch.bfloat16).eval()
    vocab = raw.get("text_config", raw)["vocab_size"]
    out = {}
    for b in ints(args.batches):
        ids = torch.randint(0, vocab, (b, 16), device=args.device)
        gen = lambda n: model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        with torch.inference_mode():
            gen(2)
            sync()
            t0 = time.perf_counter()
            gen(args.hf_tokens)
            sync()
        out[b] = b * args.hf_tokens / (time.perf_counter() - t0)
        print(f"HF batch {b}: {out[b]:.1f} tokens/s", file=sys.stderr, flush=True)
    print("RESULT " + json.dumps(out), flush=True)


def distinct_tokens(engine, b: int, seed: int = 0):
    """Give slots 1..b different random last tokens: rows that all fed token 0 into zero state would route alike
    and touch only k experts per layer (the engine's sampler state starts at zeros)."""
    import jax
    import numpy as np
    ex = engine.executor
    last = np.zeros(ex.sstate.last_token.shape, np.int32)
    last[1:b + 1] = np.random.default_rng(seed).integers(0, engine.cfg.vocab_size, b)
    ex.sstate = dataclasses.replace(ex.sstate, last_token=jax.device_put(last, ex.sstate.last_token.sharding))


def count_touched(config: str, engine_args, batches, context: int, steps: int = 4) -> tuple[dict, object]:
    """({batch: mean distinct experts per MoE layer per decode step}, the weights): an engine whose MoE block also
    reports how many experts the step's tokens route to (a host callback per layer, so not the timed engine), over
    `steps` greedy steps of time_decode's rows fed distinct tokens. Each batch must be a decode bucket (a power of
    two): the count covers the step's first `rows` rows, fixed when its executable is traced."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from bench.common import random_engine
    from bench.throughput import time_decode
    from qwen35_jax.model import forward
    seen, original, rows = [], forward.moe_block, [0]

    def counting(cfg, layout, kernels, w, x, live=None):
        logits = forward.project(x[:rows[0]], w.router).reshape(-1, cfg.num_experts)
        idx = jax.lax.top_k(logits, cfg.num_experts_per_tok)[1]
        if live is not None:            # padding rows route nowhere (index E: dropped by the scatter)
            idx = jnp.where(live[:idx.shape[0], None], idx, cfg.num_experts)
        touched = jnp.zeros(cfg.num_experts, bool).at[idx].set(True, mode="drop").sum()
        jax.debug.callback(lambda n: seen.append(int(n)), touched)
        return original(cfg, layout, kernels, w, x, live)

    forward.moe_block = counting
    try:
        # no executable cache: its key is the source, not the HLO, so the timed engine would load these
        engine = random_engine(config, dataclasses.replace(engine_args, compilation_cache_dir=""))
        if not engine.cfg.moe:
            sys.exit(f"{config} is not a MoE config")
        out = {}
        for b in batches:
            if b & (b - 1):
                raise ValueError(f"--batches must be powers of two (decode buckets), got {b}")
            rows[0] = b
            distinct_tokens(engine, b)
            time_decode(engine, b, context, steps)      # compiles, warms up, steps; each step reports every layer
            jax.effects_barrier()
            out[b] = float(np.mean(seen))
            seen.clear()
        w = engine.weights
        engine.shutdown()
        del engine
        gc.collect()
    finally:
        forward.moe_block = original
    return out, w


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--hf-tokens", type=int, default=32, help="tokens HF generates per timed run (0: no HF run)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="the engine's (default 0.9): 0.98 leaves 64 rows' state room beside 35B-A3B on an 80 GB card")
    ap.add_argument("--ttft", default="", help="prompt lengths to time to the first token, e.g. 2048,8192")
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--hf-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    from bench.common import add_kernel_args
    add_kernel_args(ap)
    args = ap.parse_args()
    if args.hf_child:                   # torch only: this process must not import JAX
        return hf_child(args)
    hf = {}
    if args.hf_tokens:
        cmd = [sys.executable, os.path.abspath(__file__), "--hf-child", "--config", args.config, "--batches",
               args.batches, "--hf-tokens", str(args.hf_tokens), "--device", args.device]
        p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
        hf = {int(k): v for k, v in json.loads(line[7:]).items()} if line else {}
        if not hf:
            print(f"the HF run failed (exit {p.returncode}): {p.stdout[-2000:]}", flush=True)

    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")     # 35B-A3B's ~68 GB: JAX's 75% is too little
    import jax
    from bench import results
    from bench.common import kernel_config, random_engine
    from bench.throughput import copy_bandwidth, time_decode
    from qwen35_jax.engine.engine import EngineArgs
    from qwen35_jax.tools.profile import decode_floor_bytes
    batches = ints(args.batches)
    engine_args = EngineArgs(max_model_len=args.context + 64, max_num_seqs=max(batches), max_num_batched_tokens=2048,
                             max_prefill_rows=1, precompile=False, enable_prefix_caching=False,
                             kernel_config=kernel_config(args),
                             **({} if args.gpu_memory_utilization is None
                                else {"gpu_memory_utilization": args.gpu_memory_utilization}))
    touched, w = count_touched(args.config, engine_args, batches, args.context)
    engine = random_engine(args.config, engine_args, weights=w)
    cfg = engine.cfg
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    bw = copy_bandwidth()
    rows = []
    for b in batches:
        distinct_tokens(engine, b)
        step = time_decode(engine, b, args.context, args.iters)["step"]
        floor = sum(decode_floor_bytes(cfg, w, engine.executor.state, b, args.context, touched[b]).values())
        row = {"batch": b, "step_ms": step * 1e3, "experts_touched_per_layer": touched[b],
               "uniform_expectation": e * (1 - (1 - k / e) ** b), "floor_ms": floor / bw * 1e3,
               "over_floor": step * bw / floor, "tokens_per_s": b / step}
        if b in hf:
            row.update(hf_tokens_per_s=hf[b], over_hf=b / step / hf[b])
        print(row, flush=True)
        rows.append(row)
    engine.shutdown()
    ttft_rows = ttft(args, w, bw) if args.ttft else []
    fmt = [{c: f"{v:.3f}" if isinstance(v, float) else v for c, v in r.items()} for r in rows]
    cols = sorted({c for r in rows for c in r}, key=lambda c: list(rows[-1]).index(c) if c in rows[-1] else 99)
    body = (f"Model `{os.path.basename(args.config)}` shapes, random bf16 weights ({sum(x.nbytes for x in
            jax.tree.leaves(w)) / 1e9:.1f} GB), context {args.context}, copy bandwidth {bw / 1e12:.2f} TB/s. Floor: "
            f"non-expert weights + the experts the step's routing touched (counted per layer on the same inputs) + GDN "
            f"state + K/V. "
            + (f"HF: transformers generate of {args.hf_tokens} tokens, bf16." if hf else "No HF run.") + "\n\n"
            + results.table([{c: r.get(c, "") for c in cols} for r in fmt], cols))
    if ttft_rows:
        body += ("\n\nTime to the first token of one prompt (chunks of 2048 tokens, median of 3); expert floor: "
                 "every expert's weights read once per chunk over the copy bandwidth.\n\n"
                 + results.table([{c: f"{v:.1f}" if isinstance(v, float) else v for c, v in r.items()}
                                  for r in ttft_rows], list(ttft_rows[0])))
    print(body)
    if args.record:
        results.record("MoE decode against its floor and HF (bench/moe.py)", body,
                       fields={"rows": rows, "hf": hf, "ttft": ttft_rows})


def ttft(args, w, bw) -> list[dict]:
    """Seconds to the first token of one prompt per --ttft length, on an engine of its own over the same weights."""
    import statistics

    from bench.common import kernel_config, prompt_ttfts, random_engine
    from qwen35_jax.engine.engine import EngineArgs
    lens, chunk = ints(args.ttft), 2048
    engine = random_engine(args.config, EngineArgs(
        max_model_len=max(lens) + 16, max_num_seqs=1, max_num_batched_tokens=chunk, max_prefill_rows=1,
        precompile=False, enable_prefix_caching=False, kernel_config=kernel_config(args),
        **({} if args.gpu_memory_utilization is None else {"gpu_memory_utilization": args.gpu_memory_utilization})),
        weights=w)
    layer = engine.weights.layers[0].mlp
    expert_bytes = layer.gate_up.nbytes + layer.down.nbytes
    rows = []
    for n, times in prompt_ttfts(engine, lens, chunk, reps=3).items():
        rows.append({"prompt tokens": n, "ttft ms": statistics.median(times) * 1e3,
                     "expert floor ms": -(-n // chunk) * engine.cfg.num_layers * expert_bytes / bw * 1e3})
        print(rows[-1], [round(t, 3) for t in times], flush=True)
    engine.shutdown()
    return rows

if __name__ == "__main__":
    main()

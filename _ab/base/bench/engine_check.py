"""The engine's kernel path on the GPU against its reference path: the same random-weight model and requests through
kernel_backend "pallas" and "reference", greedy, with logprobs.

The kernels are checked one by one in bench/kernels.py; this checks them where the engine calls them: inside the
model's shard_map, with the state pools donated, the GDN prefill reading and writing its slots in place, prompts
split into chunks over several steps (a chunk continues the state the previous one left), mixed with decode rows.
Compared along each request's common prefix of the two generations (where both fed the same tokens): the greedy
token's agreement and |delta logprob| of the reference's token (issue 7's bars for bf16: agreement >= 0.99, mean
|delta| <= 0.05); where the two part, the reference's own margin between its token and the other (a near tie
of a random-weight model parts them at a small margin; a wrong kernel path at any). It fails (exit status 1, after
recording) where the mean |delta| passes --max-mean-delta or a parting's margin passes --max-margin.

    python bench/engine_check.py --record                            # 9B shapes, 4 layers, on the GPU
    python bench/engine_check.py --config tests/fixtures/hf/bf16_gate/config.json \
        --backends pallas_interpret reference --prompt-lens 1,65,130,3 --budget 64 --max-model-len 200   # CPU
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import results  # noqa: E402
from bench.common import random_engine  # noqa: E402
from qwen35_jax.model.backends import KernelConfig  # noqa: E402
from qwen35_jax.engine.engine import EngineArgs  # noqa: E402
from qwen35_jax.engine.sampling_params import SamplingParams  # noqa: E402


def small_config(raw: dict, layers: int) -> dict:
    """raw (an HF config, nested text_config or not) cut to `layers` layers (every 4th full attention)."""
    raw = json.loads(json.dumps(raw))
    text = raw.get("text_config", raw)
    text["num_hidden_layers"] = layers
    text["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    return raw


def run(raw: dict, config: KernelConfig, prompts, params, args) -> tuple[list, KernelConfig]:
    """The requests' outputs through an engine of this kernel configuration (random weights of seed 0), and the
    configuration as the engine resolved it."""
    eargs = EngineArgs(max_model_len=args.max_model_len, max_num_seqs=len(prompts), precompile=False,
                       max_num_batched_tokens=args.budget, max_prefill_rows=2, kernel_config=config)
    engine = random_engine(raw, eargs)
    try:
        return engine.generate(prompts, [params] * len(prompts)), engine.kernel_config
    finally:
        engine.shutdown()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="bench/configs/qwen3.5-9b.json")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--backends", nargs=2, default=["pallas", "reference"])
    ap.add_argument("--kernel-config", default="", help="KernelConfig fields of the first backend's engine")
    ap.add_argument("--prompt-lens", default="1,65,300,1000,777,2")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens: longer prompts go in chunks")
    ap.add_argument("--max-model-len", type=int, default=1088)
    ap.add_argument("--max-mean-delta", type=float, default=0.05, help="bar on the mean |delta logprob|")
    ap.add_argument("--max-margin", type=float, default=0.1,
                    help="bar on the reference's margin where the two generations part (nats)")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()

    raw = small_config(json.load(open(args.config)), args.layers)
    vocab = raw.get("text_config", raw)["vocab_size"]
    rng = np.random.default_rng(0)
    lens = [int(n) for n in args.prompt_lens.split(",")]
    prompts = [rng.integers(0, vocab, n).tolist() for n in lens]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True, logprobs=5)
    configs = [KernelConfig.parse(args.kernel_config, KernelConfig(backend=args.backends[0])),
               KernelConfig(backend=args.backends[1])]
    (out_a, used), (out_r, _) = (run(raw, c, prompts, params, args) for c in configs)
    outs = dict(zip(args.backends, (out_a, out_r)))
    a_name, r_name = args.backends
    rows, agree, positions, deltas, margins = [], 0, 0, [], []
    for n, a, r in zip(lens, outs[a_name], outs[r_name]):
        ta, tr = a.outputs[0].token_ids, r.outputs[0].token_ids
        same = next((i for i, (x, y) in enumerate(zip(ta, tr)) if x != y), len(tr))
        compared = min(same + 1, len(tr))                # the positions fed the same tokens in both
        d = [abs(a.outputs[0].logprobs[i][tr[i]].logprob - r.outputs[0].logprobs[i][tr[i]].logprob)
             for i in range(compared) if tr[i] in a.outputs[0].logprobs[i]]
        agree += sum(ta[i] == tr[i] for i in range(compared))
        positions += compared
        deltas += d
        margin = "-"
        if same < len(tr):                              # the reference's logprob of its token over the other's
            ref_lp = r.outputs[0].logprobs[same]
            margins.append(ref_lp[tr[same]].logprob - ref_lp[ta[same]].logprob if ta[same] in ref_lp else np.inf)
            margin = f"{margins[-1]:.4f}" if np.isfinite(margins[-1]) else "beyond the reference's top 5"
        rows.append({"prompt tokens": n, "identical leading tokens": f"{same} / {len(tr)}",
                     "max abs delta logprob": f"{max(d):.4f}" if d else "-", "margin where they part": margin})
        print(rows[-1], flush=True)
    ok = np.mean(deltas) <= args.max_mean_delta and all(m <= args.max_margin for m in margins)
    summary = (f"top-1 agreement {agree / positions:.4f} over {positions} positions, mean |delta logprob| "
               f"{np.mean(deltas):.4f} over {len(deltas)}; {len(margins)} parting(s), largest margin "
               f"{max(margins, default=0.0):.4f}: {'PASS' if ok else 'FAIL'} (bars: mean |delta| <= "
               f"{args.max_mean_delta}, margin <= {args.max_margin})")
    print(summary, flush=True)
    if args.record:
        body = (f"Model: `{args.config}` cut to {args.layers} layers, random bf16 weights; {len(lens)} requests "
                f"at once (prompts of {args.prompt_lens} tokens, chunks of at most {args.budget} tokens per step, "
                f"greedy, {args.output_len} output tokens, logprobs), `{a_name}` against `{r_name}` "
                f"(on {jax.devices()[0].device_kind}). Compared along each request's common prefix of the two "
                f"generations and the first position where they part.\n\n"
                + results.table(rows, list(rows[0])) + f"\n{summary}.\n")
        changes = used.changes()
        results.record(f"Engine kernel path check (bench/engine_check.py): {a_name} vs {r_name}"
                       + (f", {changes}" if changes else ""), body)
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()

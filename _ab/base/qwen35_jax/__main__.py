"""`python -m qwen35_jax`: generate from the default model (or --model DIR / repo id): the whole path, once."""
import argparse
import time

from qwen35_jax import LLM, SamplingParams, env
from qwen35_jax.model.hub import DEFAULT_DESCRIPTION


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="HF model directory or repo id (default: the shipped default model)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--prompt", default="The for statement in Python")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()
    print(f"model: {args.model or DEFAULT_DESCRIPTION}", flush=True)
    t0 = time.perf_counter()
    # A small bucket set keeps the one-time compile short on a CPU; the persistent cache makes later starts fast.
    llm = LLM(model=args.model, tensor_parallel_size=args.tensor_parallel_size, max_model_len=1024, max_num_seqs=4,
              max_num_batched_tokens=256, max_prefill_rows=1)
    print(f"ready in {time.perf_counter() - t0:.1f}s, {llm.engine.precompile_seconds:.1f}s of it compiling or loading "
          f"the engine's executables (the first run compiles them; later runs load them from {env.cache_root()})")
    with llm:           # stops the engine's loop thread before the interpreter exits
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
        print(f"prompt: {args.prompt!r}")
        t0 = time.perf_counter()
        out = llm.generate(args.prompt, params)[0].outputs[0]
        dt = time.perf_counter() - t0
        print(f"completion: {out.text!r}\n  ({len(out.token_ids)} tokens in {dt:.2f}s, {len(out.token_ids) / dt:.0f} "
              f"tokens/s, finish_reason={out.finish_reason})")
        chat = llm.chat([{"role": "user", "content": args.prompt}], params,
                        chat_template_kwargs={"enable_thinking": False})[0].outputs[0]
        print(f"chat: {chat.text!r}")


if __name__ == "__main__":
    main()

"""`python -m qwen35_jax`: generate from the embedded tiny model (or --model DIR) to show the whole path works."""
import argparse
import time

from qwen35_jax.llm import LLM
from qwen35_jax.engine.sampling_params import SamplingParams
from qwen35_jax.tools.make_tiny_model import default_model_dir


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="HF model directory or repo id (default: the embedded tiny model)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()
    model = args.model or default_model_dir()
    t0 = time.perf_counter()
    # A small bucket set keeps the one-time compile short on a CPU; the persistent cache makes later starts fast.
    llm = LLM(model=model, tensor_parallel_size=args.tensor_parallel_size, max_model_len=1024, max_num_seqs=4,
              max_num_batched_tokens=256, max_prefill_rows=1)
    print(f"loaded {model} in {time.perf_counter() - t0:.1f}s")
    with llm:           # stops the engine's loop thread before the interpreter exits
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
        out = llm.generate(args.prompt, params)[0].outputs[0]
        print(f"completion: {out.text!r} ({len(out.token_ids)} tokens, finish_reason={out.finish_reason})")
        chat = llm.chat([{"role": "user", "content": args.prompt}], params,
                        chat_template_kwargs={"enable_thinking": False})[0].outputs[0]
        print(f"chat: {chat.text!r}")


if __name__ == "__main__":
    main()

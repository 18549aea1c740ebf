"""Where the engine thread's host time goes during decode: cProfile over the engine thread for one timed generate.

Decode is host-bound where the host's work per step (scheduling, laying out inputs, dispatch, reading tokens back,
detokenizing, stop checks, outputs) exceeds the device step. This runs `--rows` requests of `--tokens` tokens
(optionally every row constrained by a bench/structured.py schema), first to warm up (compiles), then timed with
cProfile enabled on the engine thread only, and prints the step time with the engine's own wait / host split and
the functions with the most own time. cProfile slows Python code down (roughly 1.5-2x), so read the split from the
unprofiled run first, then the profile for where the Python time goes.
"""
import os
import sys

# the repo, not bench/ (this script's directory), whose profile.py would shadow the standard library's cProfile needs
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import argparse  # noqa: E402
import cProfile  # noqa: E402
import io  # noqa: E402
import pstats  # noqa: E402
import time  # noqa: E402

from bench.structured import SCHEMAS, model_dir  # noqa: E402
from qwen35_jax import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from qwen35_jax.engine.engine import Engine  # noqa: E402

PROFILE = {"want": False, "prof": None}
_process = Engine._process


def _profiled_process(self, records):
    """Engine._process, switching cProfile on or off on the engine thread (enable() profiles its calling thread)."""
    if PROFILE["want"] and PROFILE["prof"] is None:
        PROFILE["prof"] = cProfile.Profile()
        PROFILE["prof"].enable()
    elif not PROFILE["want"] and PROFILE["prof"] is not None and not PROFILE.get("done"):
        PROFILE["prof"].disable()
        PROFILE["done"] = True
    return _process(self, records)


def timed(llm, rows, tokens, spec):
    params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=0, ignore_eos=spec is None,
                            structured_outputs=spec)
    st = llm.engine.stats
    before = (st.steps, st.wait_seconds, st.host_seconds)
    t0 = time.perf_counter()
    llm.generate([f"Row {i}: list some names as JSON." for i in range(rows)], params)
    dt, steps = time.perf_counter() - t0, max(1, st.steps - before[0])
    ms = lambda seconds: f"{1e3 * seconds / steps:.2f}"
    return (f"{rows} rows: {ms(dt)} ms per step, waiting {ms(st.wait_seconds - before[1])}, host "
            f"{ms(st.host_seconds - before[2])} ({steps} steps)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="a config.json at real shapes (random weights); default: the default model")
    ap.add_argument("--tokenizer", default="/tmp/qwen35-bench-tokenizer", help="directory of tokenizer.json")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--schema", choices=list(SCHEMAS), help="constrain every row (default: none)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--speculative-tokens", type=int, default=0, help="k MTP drafts per step (0: none)")
    args = ap.parse_args()
    path = model_dir(args.config, args.tokenizer)
    kw = dict(load_format="dummy") if path else {}
    spec = StructuredOutputsParams(json=SCHEMAS[args.schema]) if args.schema else None
    Engine._process = _profiled_process
    if args.speculative_tokens:
        kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": args.speculative_tokens}
    with LLM(path, max_num_seqs=args.rows, dtype=args.dtype, max_model_len=1024, precompile=False, **kw) as llm:
        timed(llm, args.rows, 8, spec)
        if spec is not None:
            llm.engine.executor.wait_split()
            timed(llm, args.rows, 8, spec)
        print("unprofiled:", timed(llm, args.rows, args.tokens, spec), flush=True)
        PROFILE["want"] = True
        print("profiled:  ", timed(llm, args.rows, args.tokens, spec), flush=True)
        PROFILE["want"] = False
        timed(llm, args.rows, 2, spec)         # a step on the engine thread switches the profiler off
    out = io.StringIO()
    pstats.Stats(PROFILE["prof"], stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())


if __name__ == "__main__":
    main()

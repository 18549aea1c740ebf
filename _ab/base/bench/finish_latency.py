"""Host latency of a request's end: from its last token being read back (the engine's first-token hook, for a
max_tokens=1 request) to its final output callback, on the tiny random model on this machine's CPU.

What lies between is the engine's own bookkeeping of a finished request: since e0dae7b its slot, pages and
prefix-cache snapshot are returned after the output is delivered, where before they came first (and grew with the
prompt's pages). --roots times other source trees side by side (e.g. one made by bench/ab_tree.sh).

    python bench/finish_latency.py --length 32752 --roots .,_ab/base --record
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(args):
    sys.path.insert(0, os.path.abspath(args.root))
    import numpy as np

    from bench.common import random_engine
    from qwen35_jax import SamplingParams
    from qwen35_jax.engine.engine import EngineArgs, Observer

    class FirstToken(Observer):
        def on_first_token(self, req):
            self.t = time.perf_counter()

    L = args.length
    engine = random_engine(os.path.join(ROOT, "bench", "configs", "tiny-248k-vocab.json"), EngineArgs(
        max_model_len=L + 16, max_num_seqs=4, max_num_batched_tokens=8192, max_prefill_rows=1, precompile=False))
    engine.observer = FirstToken()
    engine.start()
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ms = []
    for _ in range(args.requests):
        done = []
        engine.add_request(rng.integers(0, 1000, L - 8).tolist(), params,
                           lambda out: out.finished and done.append(time.perf_counter()))
        while not done:
            time.sleep(0.001)
        ms.append(1e3 * (done[0] - engine.observer.t))
    engine.shutdown()
    print(json.dumps(ms[1:]))          # the first request compiles


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=32752)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--roots", default=".")
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.root:
        return child(args)
    rows = []
    for root in args.roots.split(","):
        out = subprocess.run([sys.executable, __file__, "--root", root, "--length", str(args.length), "--requests",
                              str(args.requests)], check=True, capture_output=True, text=True).stdout
        ms = json.loads(out.strip().splitlines()[-1])
        rows.append({"tree": root, "ms (each request after the first)": " / ".join(f"{x:.2f}" for x in ms)})
        print(rows[-1], flush=True)
    sys.path.insert(0, ROOT)
    from bench import results
    body = (f"Last token read back -> final callback of a max_tokens=1 request with a {args.length}-token prompt "
            "(tiny random model, prefix cache on, this machine's CPU).\n\n" + results.table(rows, list(rows[0])))
    print(body)
    if args.record:
        results.record("End-of-request host latency (bench/finish_latency.py)", body)


if __name__ == "__main__":
    main()

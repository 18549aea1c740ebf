"""Host latency of a request's end: from its last token being read back (the engine's first-token hook, for a
max_tokens=1 request) to its final output callback, on the tiny random model on this machine's CPU.

What lies between is the engine's own bookkeeping of a finished request: since e0dae7b its slot, pages and
prefix-cache snapshot are returned after the output is delivered, where before they came first (and grew with the
prompt's pages). Also timed: the final callback -> the caller's thread waking on it (`caller`), which waits for
the GIL while the engine thread holds it. --roots times other source trees side by side (e.g. one made by
bench/ab_tree.sh), --rounds times alternately. Medians over the requests after the first (which compiles).

    python bench/finish_latency.py --length 32752 --roots .,_ab/base --record
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
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
    callback, caller = [], []
    for _ in range(args.requests):
        done, woke = [], threading.Event()

        def cb(out):
            if out.finished:
                done.append(time.perf_counter())
                woke.set()
        engine.add_request(rng.integers(0, 1000, L - 8).tolist(), params, cb)
        woke.wait()
        t = time.perf_counter()
        callback.append(1e3 * (done[0] - engine.observer.t))
        caller.append(1e3 * (t - done[0]))
        time.sleep(0.05)
    engine.shutdown()
    print(json.dumps({"callback": callback[1:], "caller": caller[1:]}))     # the first request compiles


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=32752)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--roots", default=".")
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.root:
        return child(args)
    runs = {}
    for _ in range(args.rounds):
        for root in args.roots.split(","):
            out = subprocess.run([sys.executable, __file__, "--root", root, "--length", str(args.length),
                                  "--requests", str(args.requests)], check=True, capture_output=True, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(root, {k: [round(x, 2) for x in v] for k, v in r.items()}, flush=True)
            for k, v in r.items():
                runs.setdefault(root, {}).setdefault(k, []).extend(v)
    rows = [{"tree": root, "requests": len(r["callback"]),
             **{f"{k} ms p50 / p90": f"{statistics.median(v):.2f} / {statistics.quantiles(v, n=10)[-1]:.2f}"
                for k, v in r.items()}} for root, r in runs.items()]
    sys.path.insert(0, ROOT)
    from bench import results
    body = (f"A max_tokens=1 request with a {args.length}-token prompt (tiny random model, prefix cache on, this "
            "machine's CPU): callback = its token read back -> its final callback; caller = that callback -> the "
            f"waiting thread running. {args.rounds} round(s) of {args.requests} requests per tree.\n\n"
            + results.table(rows, list(rows[0])))
    print(body)
    if args.record:
        results.record("End-of-request host latency (bench/finish_latency.py)", body)


if __name__ == "__main__":
    main()

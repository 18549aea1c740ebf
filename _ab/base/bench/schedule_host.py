"""Host time of Scheduler.schedule() per step while one long prompt prefills beside 16 decode rows (no device).

The scheduler runs before each step's dispatch, so its time is on the critical path once it exceeds the device
step. This drives it alone: 16 rows of 256-token prompts decoding, then one prompt of --length tokens prefilled in
mixed steps of --chunk tokens (the engine's default shapes otherwise: prefill chunks up to
--max-num-batched-tokens, page size 16), with the prefix cache on (--snapshots entries) and off (0). --roots
times other source trees side by side in child processes (e.g. one made by bench/ab_tree.sh), each alternately.
admit: the step that admits the long prompt (its lookup hashes every page); release: returning it once finished
(its end-of-request snapshot pins every page).

    python bench/schedule_host.py --length 131072 --chunk 64 --roots .,_ab/base --record
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

    from qwen35_jax.engine.sampling_params import SamplingParams
    from qwen35_jax.engine.scheduler import Request, Scheduler, Status
    ps, n, L, C = 16, 16, args.length, args.chunk
    top = args.max_num_batched_tokens
    s = Scheduler(num_slots=n + 4, num_pages=(L + n * (256 + 4096)) // ps + 64, page_size=ps, max_model_len=L + 64,
                  max_num_batched_tokens=top, decode_buckets=[1, 8, 16, 32],
                  prefill_buckets=[(1, 2 ** k) for k in range(5, top.bit_length())],
                  num_snapshots=args.snapshots, decode_prefill_budget=C,
                  mixed=[(1, 2 ** k) for k in range(5, C.bit_length())])
    rng = np.random.default_rng(0)
    for i in range(n):
        s.add(Request(f"d{i}", rng.integers(0, 1000, 256).tolist(), SamplingParams(max_tokens=4096), 0, 4096))
    long = Request("long", rng.integers(0, 1000, L).tolist(), SamplingParams(max_tokens=1), 0, 1)
    s.add(long)
    times, admit = [], None
    while not long.prefill_done:
        waiting = long.status is Status.WAITING
        t0 = time.perf_counter()
        plan = s.schedule()
        dt = time.perf_counter() - t0
        if waiting and long.status is Status.RUNNING:
            admit = dt
        elif any(c.request is long for c in plan.prefill):
            times.append(dt)
        for c in plan.prefill:
            c.request.num_computed += c.length
            c.request.num_sampled += c.completes_prompt
        for r in plan.decode:
            r.num_computed += 1
            r.num_sampled += 1
    long.output_ids.append(1)
    t0 = time.perf_counter()
    s.finish(long)
    s.release()
    release = time.perf_counter() - t0
    t = np.array(times) * 1e3
    print(json.dumps({"steps": len(t), "admit_ms": 1e3 * admit, "release_ms": 1e3 * release,
                      "p50_ms": float(np.median(t)), "p99_ms": float(np.percentile(t, 99)),
                      "last_tenth_ms": float(t[-max(1, len(t) // 10):].mean()), "max_ms": float(t.max()),
                      "total_ms": float(t.sum())}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--chunk", type=int, default=64, help="the mixed steps' prompt tokens (decode_prefill_budget)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--snapshots", default="40,0", help="prefix-cache snapshot entries to time (0: cache off)")
    ap.add_argument("--roots", default=".", help="comma-separated source trees")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.root:
        args.snapshots = int(args.snapshots)
        return child(args)
    roots = args.roots.split(",")
    runs = {}
    for _ in range(args.rounds):
        for snaps in args.snapshots.split(","):
            for root in roots:
                out = subprocess.run([sys.executable, __file__, "--root", root, "--length", str(args.length),
                                      "--chunk", str(args.chunk), "--snapshots", snaps,
                                      "--max-num-batched-tokens", str(args.max_num_batched_tokens)],
                                     check=True, capture_output=True, text=True).stdout
                r = json.loads(out.strip().splitlines()[-1])
                print(root, snaps, r, flush=True)
                runs.setdefault((root, snaps), []).append(r)
    rows = []
    for (root, snaps), rs in runs.items():
        best = min(rs, key=lambda r: r["total_ms"])
        rows.append({"tree": root, "snapshots": snaps, "steps": best["steps"],
                     **{k: f"{best[k]:.3f}" for k in ("admit_ms", "p50_ms", "p99_ms", "last_tenth_ms", "max_ms",
                                                   "release_ms")},
                     "total_ms": f"{best['total_ms']:.0f}"})
    sys.path.insert(0, ROOT)
    from bench import results
    body = (f"Scheduler.schedule() host time per step of a {args.length}-token prompt prefilled in mixed steps of "
            f"{args.chunk} tokens beside 16 decode rows (page size 16, prefill chunks up to "
            f"{args.max_num_batched_tokens}); snapshots 0 = prefix cache off; admit = the step admitting it, "
            f"release = returning it once finished. Best of {args.rounds} runs by total.\n\n"
            + results.table(rows, list(rows[0])))
    print(body)
    if args.record:
        results.record("Scheduler host time during a long mixed prefill (bench/schedule_host.py)", body)


if __name__ == "__main__":
    main()

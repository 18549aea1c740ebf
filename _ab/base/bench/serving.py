"""HTTP serving benchmark, like vLLM's `bench serve`: random token-id prompts of a given length through
/v1/completions (streaming), at a fixed concurrency or a Poisson request rate; TTFT / TPOT / ITL / E2E percentiles,
request and token throughput, errors; JSON out. With --compare it also runs the same workload (same prompts,
same arrival schedule, same engine flags) through the in-process engine (Engine.generate_async, in a child process
run first), and reports HTTP / in-process output throughput side by side (issue 5's target: >= 0.90).

  # against a running server
  python bench/serving.py --base-url http://127.0.0.1:8000 --vocab-size 248320 --num-prompts 64 \\
      --input-len 1024 --output-len 256 --max-concurrency 16 --ignore-eos
  # start the server itself (flags after -- go to `python -m qwen35_jax.serve`), and the in-process engine too
  python bench/serving.py --compare --config bench/configs/qwen3.5-9b.json --num-prompts 64 --input-len 1024 \\
      --output-len 256 --max-concurrency 16 --ignore-eos --result-file /tmp/serving.json -- --max-model-len 1536 \\
      --max-num-seqs 16

--config CONFIG.json serves random weights at that config's shapes (a temporary model directory holding only
config.json; `--load-format dummy --skip-tokenizer-init`), so prompts are token ids and outputs are not detokenized
on either side.

On the GPU machine (no fastapi/uvicorn there) carry these wheels (cp312, manylinux x86_64): fastapi==0.165.0
starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
typing-inspection==0.4.5 typing-extensions==4.16.0 opentelemetry-api==1.45.2 (fastapi imports it); anyio, h11,
click, httpx, httpcore, prometheus-client, annotated-doc and uvloop are in its image. Download them here with
  pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
      --platform manylinux_2_17_x86_64 -d .whl fastapi==0.165.0 starlette==1.10.0 ...
then, there (carry .whl):
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.
  python3 bench/serving.py --compare --config bench/configs/qwen3.5-9b.json --num-prompts 64 --input-len 1024 \\
      --output-len 256 --max-concurrency 16 --ignore-eos --result-file $OUT/serving.json --record \\
      -- --max-model-len 1536 --max-num-seqs 16
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET_RATIO = 0.90


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args = []
    if "--" in argv:
        k = argv.index("--")
        argv, serve_args = argv[:k], argv[k + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_argument_group("what to benchmark")
    where.add_argument("--base-url", default=None, help="a running server (otherwise one is started)")
    where.add_argument("--api-key", default=os.environ.get("QWEN35_API_KEY"))
    where.add_argument("--config", default=None,
                       help="serve random weights at this HF config's shapes (implies token-id prompts)")
    where.add_argument("--in-process", action="store_true", help="only the in-process engine, no HTTP")
    where.add_argument("--compare", action="store_true", help="HTTP (started here) and in-process, side by side")
    where.add_argument("--launch-timeout", type=float, default=1800, help="seconds for a started server to be healthy")
    w = ap.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=64)
    w.add_argument("--input-len", type=int, default=1024)
    w.add_argument("--output-len", type=int, default=256)
    w.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: all)")
    w.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    w.add_argument("--ignore-eos", action="store_true", help="every request generates exactly --output-len tokens")
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--num-warmups", type=int, default=2, help="untimed requests first (same lengths)")
    w.add_argument("--vocab-size", type=int, default=None,
                   help="prompt ids are uniform in [0, 0.95 x vocab) (default: from the model's config.json)")
    w.add_argument("--seed", type=int, default=0)
    o = ap.add_argument_group("output")
    o.add_argument("--result-file", default=None, help="write the results as JSON here")
    o.add_argument("--record", action="store_true", help="record the run under bench/runs/ (bench/results.py)")
    args = ap.parse_args(argv)
    if args.base_url and (args.compare or args.in_process):
        ap.error("--base-url measures an existing server; --compare/--in-process start their own")
    if args.base_url and serve_args:
        ap.error("flags after -- are for a server this script starts; drop --base-url")
    return args, serve_args


# -- workload ----------------------------------------------------------------------------------------------------
def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Random token ids; the top 5% of the vocabulary (where Qwen keeps its special tokens) is left out."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, max(2, int(vocab * 0.95)), size=(n, length)).tolist()


@dataclasses.dataclass
class Result:
    error: str | None = None
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list = dataclasses.field(default_factory=list)


def check(res: Result, args, token_times: list[float], t0: float, finished: bool) -> Result:
    if res.error is None and not finished:
        res.error = "the response ended before the request finished"
    if res.error is None and not token_times:
        res.error = "no tokens received"
    if res.error is None and args.ignore_eos and res.output_tokens != args.output_len:
        res.error = f"expected {args.output_len} tokens with ignore_eos, got {res.output_tokens}"
    if token_times:
        res.ttft = token_times[0] - t0
        res.e2e = token_times[-1] - t0
        res.itl = np.diff(token_times).tolist()
    return res


async def run_workload(send, prompts, args) -> tuple[list[Result], float]:
    """Start requests on the Poisson schedule (all at once for an infinite rate), at most max_concurrency at a time."""
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    rng = np.random.default_rng(args.seed + 1)

    async def limited(p):
        if sem is None:
            return await send(p)
        async with sem:
            return await send(p)

    tasks = []
    t0 = time.perf_counter()
    for p in prompts:
        tasks.append(asyncio.create_task(limited(p)))
        if np.isfinite(args.request_rate):
            await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - t0


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.error is None]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)

    def stats(xs):
        xs = np.asarray(xs, float) * 1e3
        if not len(xs):
            return None
        return {"mean": float(xs.mean()), "median": float(np.median(xs)), "p90": float(np.percentile(xs, 90)),
                "p99": float(np.percentile(xs, 99)), "max": float(xs.max())}

    errors = [r.error for r in results if r.error is not None]
    return {
        "completed": len(ok), "failed": len(errors), "errors": sorted(set(errors))[:5],
        "duration_s": duration, "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": stats([r.ttft for r in ok]),
        "tpot_ms": stats([(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]),
        "itl_ms": stats([x for r in ok for x in r.itl]),
        "e2el_ms": stats([r.e2e for r in ok]),
    }


# -- HTTP --------------------------------------------------------------------------------------------------------
def _counters(text: str) -> dict:
    out = {}
    for name in ("qwen35:engine_steps_total", "qwen35:generation_tokens_total", "qwen35:prompt_tokens_total",
                 "qwen35:engine_host_seconds_total", "qwen35:engine_wait_seconds_total"):
        m = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)
        if m:
            out[name.split(":")[1]] = float(m.group(1))
    return out


async def run_http(base_url: str, prompts, warm, args) -> dict:
    import httpx
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=None, limits=limits) as client:
        model = (await client.get("/v1/models")).raise_for_status().json()["data"][0]["id"]

        async def send(prompt) -> Result:
            payload = {"model": model, "prompt": prompt, "max_tokens": args.output_len, "stream": True,
                       "stream_options": {"include_usage": True}, "temperature": args.temperature,
                       "ignore_eos": args.ignore_eos}
            res, times, finished = Result(prompt_len=len(prompt)), [], False
            t0 = time.perf_counter()
            try:
                async with client.stream("POST", "/v1/completions", json=payload) as r:
                    if r.status_code != 200:
                        res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                        return res
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            finished = True
                            break
                        obj = json.loads(line[6:])
                        if "error" in obj:
                            res.error = f"stream error: {obj['error'].get('message')}"
                            break
                        if obj.get("choices"):
                            times.append(time.perf_counter())
                        if obj.get("usage"):
                            res.output_tokens = obj["usage"]["completion_tokens"]
            except Exception as e:        # a connection failure is a failed request, counted and reported
                res.error = f"{type(e).__name__}: {e}"
            return check(res, args, times, t0, finished)

        if warm:
            await run_workload(send, warm, _replace(args, request_rate=float("inf")))
        before = _counters((await client.get("/metrics")).text)
        results, duration = await run_workload(send, prompts, args)
        after = _counters((await client.get("/metrics")).text)
    summary = summarize(results, duration)
    d = {k: after[k] - before.get(k, 0) for k in after}
    steps = max(1, d.get("engine_steps_total", 0))
    summary["server"] = {"engine_steps_total": d.get("engine_steps_total"),
                         "generation_tokens_total": d.get("generation_tokens_total"),
                         "prompt_tokens_total": d.get("prompt_tokens_total"),
                         "host_ms_per_step": 1e3 * d.get("engine_host_seconds_total", float("nan")) / steps,
                         "wait_ms_per_step": 1e3 * d.get("engine_wait_seconds_total", float("nan")) / steps}
    return summary


def _replace(args, **kw):
    ns = argparse.Namespace(**vars(args))
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


_LIBC = None
if sys.platform.startswith("linux"):
    import ctypes
    _LIBC = ctypes.CDLL(None, use_errno=True)      # loaded here: the child between fork and exec only calls it


def _die_with_parent():
    """preexec_fn: the server is killed if the process that started it dies (Linux), so it never lingers as an
    orphan holding the GPU or a port."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG


class Server:
    """`python -m qwen35_jax.serve` on a free loopback port (this script's server, and the server tests'). Start-up
    is bounded: the process must print its address and answer /health within `timeout` seconds, or the log's tail
    is raised. Stopped as a process group (SIGTERM, then SIGKILL)."""

    def __init__(self, serve_args: list[str], timeout: float = 240.0, env: dict | None = None, keep_log: bool = True):
        import httpx
        self.keep_log = keep_log
        self.log = tempfile.NamedTemporaryFile("w+", prefix="qwen35-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "qwen35_jax.serve", "--host", "127.0.0.1", "--port", "0", *serve_args]
        env = env or dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        print("starting:", " ".join(cmd), f"(log: {self.log.name})", flush=True)
        with warnings.catch_warnings():     # JAX warns on any fork; this child only calls prctl, then exec
            warnings.filterwarnings("ignore", message="os.fork", category=RuntimeWarning)
            self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        deadline, self.url = time.monotonic() + timeout, None
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"server not healthy after {timeout:.0f}s:\n{self.tail()}")
                if self.url is None:
                    m = re.search(r"serving .* on (http://\S+)", open(self.log.name).read())
                    self.url = m.group(1) if m else None
                if self.url is not None:
                    try:
                        if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise

    def tail(self, n: int = 4000) -> str:
        return open(self.log.name).read()[-n:]

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        if not self.keep_log:
            os.unlink(self.log.name)


# -- in-process --------------------------------------------------------------------------------------------------
def run_engine(serve_args: list[str], prompts, warm, args) -> dict:
    """The same workload through Engine.generate_async in this process (the engine built from the server's flags)."""
    sys.path.insert(0, ROOT)
    from qwen35_jax.engine.sampling_params import SamplingParams
    from qwen35_jax.engine.engine import build_engine
    from qwen35_jax.serve import build_parser, engine_args
    from qwen35_jax.model.hub import default_model_dir
    cli = build_parser().parse_args(serve_args)
    engine = build_engine(cli.model or default_model_dir(), engine_args(cli))
    params = SamplingParams(max_tokens=args.output_len, temperature=args.temperature, ignore_eos=args.ignore_eos)

    async def send(prompt) -> Result:
        res, times, n, finished = Result(prompt_len=len(prompt)), [], 0, False
        t0 = time.perf_counter()
        try:
            async for out in engine.generate_async(prompt, params):
                c = out.outputs[0]
                if len(c.token_ids) > n:
                    times.append(time.perf_counter())
                    n = len(c.token_ids)
                if c.finish_reason == "error":
                    res.error = "engine error"
                finished = out.finished
        except Exception as e:
            res.error = f"{type(e).__name__}: {e}"
        res.output_tokens = n
        return check(res, args, times, t0, finished)

    async def main():
        if warm:
            await run_workload(send, warm, _replace(args, request_rate=float("inf")))
        s0 = dict(vars(engine.stats))
        results, duration = await run_workload(send, prompts, args)
        summary = summarize(results, duration)
        s1 = vars(engine.stats)
        summary["server"] = {"engine_steps_total": s1["steps"] - s0["steps"],
                             "generation_tokens_total": s1["generation_tokens"] - s0["generation_tokens"],
                             "prompt_tokens_total": s1["prompt_tokens"] - s0["prompt_tokens"],
                             "host_ms_per_step": 1e3 * (s1["host_seconds"] - s0["host_seconds"]) /
                             max(1, s1["steps"] - s0["steps"]),
                             "wait_ms_per_step": 1e3 * (s1["wait_seconds"] - s0["wait_seconds"]) /
                             max(1, s1["steps"] - s0["steps"])}
        return summary

    try:
        return asyncio.run(main())
    finally:
        engine.shutdown()


def run_child_in_process(args, vocab: int, serve_args: list[str]) -> dict:
    """`bench/serving.py --in-process` with this run's workload, in a child process; its summary."""
    out = tempfile.NamedTemporaryFile(prefix="qwen35-bench-inproc-", suffix=".json", delete=False).name
    cmd = [sys.executable, os.path.abspath(__file__), "--in-process", "--vocab-size", str(vocab), "--result-file", out]
    for name in ("num_prompts", "input_len", "output_len", "max_concurrency", "request_rate", "temperature",
                 "num_warmups", "seed"):
        if getattr(args, name) is not None:
            cmd += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    cmd += ["--ignore-eos"] if args.ignore_eos else []
    print("in-process run:", " ".join(cmd + ["--", *serve_args]), flush=True)
    r = subprocess.run(cmd + ["--", *serve_args], cwd=ROOT)
    if not os.path.exists(out) or os.path.getsize(out) == 0:
        raise RuntimeError(f"the in-process run failed (exit code {r.returncode})")
    with open(out) as f:
        result = json.load(f)["in-process"]
    os.unlink(out)
    return result


# -- report ------------------------------------------------------------------------------------------------------
def table(runs: dict) -> str:
    rows = [("completed / failed", lambda s: f"{s['completed']} / {s['failed']}"),
            ("duration s", lambda s: f"{s['duration_s']:.2f}"),
            ("request throughput req/s", lambda s: f"{s['request_throughput']:.2f}"),
            ("output throughput tok/s", lambda s: f"{s['output_throughput']:.1f}"),
            ("total token throughput tok/s", lambda s: f"{s['total_token_throughput']:.1f}")]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        for q in ("mean", "median", "p99"):
            rows.append((f"{key[:-3].upper()} {q} ms", lambda s, key=key, q=q: f"{s[key][q]:.2f}" if s[key] else "-"))
    rows.append(("engine steps", lambda s: f"{s['server']['engine_steps_total']:.0f}"))
    rows.append(("engine host ms/step", lambda s: f"{s['server']['host_ms_per_step']:.2f}"))
    rows.append(("engine wait ms/step", lambda s: f"{s['server']['wait_ms_per_step']:.2f}"))
    names = sorted(runs, key=lambda n: n != "http")
    out = ["| metric | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    out += [f"| {label} | " + " | ".join(f(runs[n]) for n in names) + " |" for label, f in rows]
    return "\n".join(out)


def model_vocab(serve_args: list[str]) -> int | None:
    if "--model" not in serve_args:
        return None
    path = os.path.join(serve_args[serve_args.index("--model") + 1], "config.json")
    with open(path) as f:
        cfg = json.load(f)
    return (cfg.get("text_config") or cfg)["vocab_size"]


def main(argv=None):
    args, serve_args = parse_args(argv)
    if args.config:
        model_dir = tempfile.mkdtemp(prefix="qwen35-bench-model-")
        with open(args.config) as f, open(os.path.join(model_dir, "config.json"), "w") as g:
            g.write(f.read())
        serve_args = ["--model", model_dir, "--load-format", "dummy", "--skip-tokenizer-init", *serve_args]
    vocab = args.vocab_size or model_vocab(serve_args)
    if vocab is None:
        sys.exit("--vocab-size is needed (no --config or --model to read it from)")
    prompts = make_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    warm = make_prompts(args.num_warmups, args.input_len, vocab, args.seed + 99)
    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "result_file", "record")}
    config["serve_args"] = serve_args
    runs = {}
    if args.compare:
        # In a child process, so its device memory is released before the server starts; and first, so the server
        # (not the baseline) is the one that finds the executables already in the persistent compilation cache.
        runs["in-process"] = run_child_in_process(args, vocab, serve_args)
    if not args.in_process:
        if args.base_url:
            runs["http"] = asyncio.run(run_http(args.base_url.rstrip("/"), prompts, warm, args))
        else:
            server = Server(["--disable-uvicorn-access-log", *serve_args] +
                            (["--api-key", args.api_key] if args.api_key else []), args.launch_timeout)
            try:
                runs["http"] = asyncio.run(run_http(server.url, prompts, warm, args))
            finally:
                server.stop()
    if args.in_process:
        runs["in-process"] = run_engine(serve_args, prompts, warm, args)
    result = {"config": config, **runs}
    if args.compare:
        ratio = runs["http"]["output_throughput"] / runs["in-process"]["output_throughput"]
        result["http_over_in_process_output_throughput"] = ratio
        result["target"] = TARGET_RATIO
        result["meets_target"] = bool(ratio >= TARGET_RATIO and not runs["http"]["failed"]
                                      and not runs["in-process"]["failed"])
    print(table(runs))
    if args.compare:
        print(f"HTTP / in-process output throughput: {result['http_over_in_process_output_throughput']:.3f} "
              f"(target >= {TARGET_RATIO}; {'met' if result['meets_target'] else 'NOT met'})")
    for name, s in runs.items():
        if s["failed"]:
            print(f"{name}: {s['failed']} failed requests, e.g. {s['errors']}")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(result, f, indent=1)
    if args.record:
        sys.path.insert(0, ROOT)
        from bench import results
        body = (f"Workload: {args.num_prompts} requests of {args.input_len} random prompt tokens and "
                f"{args.output_len} output tokens, max concurrency {args.max_concurrency}, request rate "
                f"{args.request_rate}, temperature {args.temperature}, ignore_eos {args.ignore_eos}; engine flags "
                f"`{' '.join(serve_args)}`. 'in-process' runs the same prompts and schedule through "
                f"Engine.generate_async in one process; 'http' through `python -m qwen35_jax.serve` "
                f"/v1/completions streaming.\n\n" + table(runs))
        if args.compare:
            body += (f"\n\nHTTP / in-process output throughput: "
                     f"{result['http_over_in_process_output_throughput']:.3f} (target >= {TARGET_RATIO}).")
        results.record("HTTP serving (bench/serving.py)", body, fields=result)
    failed = any(s["failed"] for s in runs.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

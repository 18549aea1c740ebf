"""Server features beyond the OpenAI API: on-demand profiling, and multi-process serving (process 0 serves HTTP,
process 1 follows) with a dead peer reported through /health."""
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from conftest import engine_args, fixture_dir
from server_proc import ENGINE_FLAGS, ROOT, ServerProcess, server_env
from qwen35_jax.llm import LLM
from qwen35_jax.engine.sampling_params import SamplingParams

CASE = "text_untied_r1_g6"
PROMPTS = [[5 + i, 17, 33 + 2 * i, 90, 4 + i] for i in range(4)]


def test_start_stop_profile(tmp_path):
    server = ServerProcess(["--model", fixture_dir(CASE), "--skip-tokenizer-init", "--profile-dir", str(tmp_path),
                            *ENGINE_FLAGS, "--no-precompile"])
    try:
        assert httpx.post(server.url + "/stop_profile").status_code == 409          # nothing running
        r = httpx.post(server.url + "/start_profile")
        assert r.status_code == 200, r.text
        assert httpx.post(server.url + "/start_profile").status_code == 409         # already running
        body = {"model": fixture_dir(CASE), "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code == 200
        r = httpx.post(server.url + "/stop_profile", timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["session_dir"].startswith(str(tmp_path)) and os.listdir(out["session_dir"])
        assert out["device_ms_by_block"].get("gdn", 0) > 0 and out["device_ms_by_block"].get("attention", 0) > 0
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        server.stop()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_server_and_dead_peer(tmp_path):
    """tp=4 over 2 processes x 2 CPU devices: HTTP outputs equal a single-process tp=4 run; killing the follower
    makes /health fail within a bounded time and a running request end with an error."""
    port = _free_port()
    flags = ["--model", fixture_dir(CASE), "--skip-tokenizer-init", "--tensor-parallel-size", "4",
             "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2",
             *ENGINE_FLAGS, "--compilation-cache-dir", "", "--no-precompile"]
    env = dict(server_env(), JAX_NUM_CPU_DEVICES="2")
    log = open(tmp_path / "follower.log", "w")
    follower = subprocess.Popen([sys.executable, "-m", "qwen35_jax.serve", *flags, "--process-id", "1"], env=env,
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    leader = None
    try:
        leader = ServerProcess([*flags, "--process-id", "0"], env=env)
        body = {"model": fixture_dir(CASE), "prompt": PROMPTS, "max_tokens": 6, "temperature": 0,
                "return_token_ids": True}
        r = httpx.post(leader.url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        got = [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
        single = LLM(fixture_dir(CASE), tensor_parallel_size=4, skip_tokenizer_init=True,
                     **engine_args(precompile=False))
        want = [o.outputs[0].token_ids for o in single.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0))]
        assert got == want

        long = {"model": fixture_dir(CASE), "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True}
        with httpx.Client(timeout=120) as c:
            pending = c.build_request("POST", leader.url + "/v1/completions", json=long)
            import threading
            result = {}
            t = threading.Thread(target=lambda: result.setdefault("r", c.send(pending)))
            t.start()
            time.sleep(1.0)
            killed = time.monotonic()
            os.killpg(follower.pid, signal.SIGKILL)
            while time.monotonic() - killed < 60:
                if httpx.get(leader.url + "/health", timeout=5).status_code == 503:
                    break
                time.sleep(0.2)
            detect = time.monotonic() - killed
            t.join(60)
        assert httpx.get(leader.url + "/health", timeout=5).status_code == 503
        assert detect < 30
        assert result["r"].status_code >= 500 or "error" in result["r"].text
    finally:
        if leader is not None:
            leader.stop()
        follower.kill()

"""Multi-process SPMD on JAX's distributed runtime (CPU, loopback): 2 processes x 2 devices."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import engine_args, fixture_dir
from qwen35_jax.llm import LLM
from qwen35_jax.sampling_params import SamplingParams

DRIVER = os.path.join(os.path.dirname(__file__), "helpers", "multihost_driver.py")
PROMPTS = [[5 + i, 17, 33 + 2 * i, 90, 4 + i] for i in range(6)]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path, tp, dp, hold=False):
    port, out = free_port(), tmp_path / f"out-{tp}-{dp}.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "PYTHONUNBUFFERED": "1"}
    args = lambda pid: [sys.executable, DRIVER, str(pid), "2", str(port), str(tp), str(dp), str(out)] + \
        (["--hold"] if hold else [])
    procs = [subprocess.Popen(args(pid), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for pid in (0, 1)]
    return procs, out


@pytest.mark.parametrize("tp,dp", [(4, 1), (2, 2)])
def test_two_processes_match_single_process(tmp_path, tp, dp):
    procs, out = launch(tmp_path, tp, dp)
    try:
        logs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], logs
    got = json.load(open(out))["tokens"]
    single = LLM(fixture_dir("text_untied_r1_g6"), tensor_parallel_size=tp, skip_tokenizer_init=True,
                 **engine_args(data_parallel_size=dp, max_num_seqs=4))
    want = [o.outputs[0].token_ids for o in single.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0,
                                                                                     ignore_eos=True))]
    assert got == want


def test_dead_peer_is_reported(tmp_path):
    procs, out = launch(tmp_path, 2, 2, hold=True)
    try:
        leader = procs[0]
        deadline = time.monotonic() + 600
        for line in leader.stdout:
            if "READY" in line or time.monotonic() > deadline:
                break
        killed = time.monotonic()
        procs[1].send_signal(signal.SIGKILL)
        leader.wait(timeout=120)
        elapsed = time.monotonic() - killed
    finally:
        for p in procs:
            p.kill()
    result = json.load(open(out))
    # reported by the peer watchdog or by the collective that lost its peer, whichever comes first: both name it
    assert result["healthy"] is False
    assert "peer process(es) [1] stopped responding" in result["error"], result["error"]
    assert result["request_finish"] == ["error"]
    assert elapsed < 30

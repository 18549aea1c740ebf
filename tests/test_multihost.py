"""Multi-process SPMD on JAX's distributed runtime (CPU, loopback): 2 processes x 2 devices."""
import json
import os
import signal
import socket
import subprocess
import sys
import time


from conftest import engine_args, fixture_dir
from qwen35_jax.llm import LLM
from qwen35_jax.engine.sampling_params import SamplingParams

DRIVER = os.path.join(os.path.dirname(__file__), "helpers", "multihost_driver.py")
PROMPTS = [[5 + i, 17, 33 + 2 * i, 90, 4 + i] for i in range(6)] + [list(range(3, 103))]    # as the driver's


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


def single_process_tokens(tp, dp):
    single = LLM(fixture_dir("text_untied_r1_g6"), tensor_parallel_size=tp, skip_tokenizer_init=True,
                 **engine_args(data_parallel_size=dp, max_num_seqs=4, precompile=False, decode_prefill_budget=32))
    outs = single.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    single.shutdown()
    return [o.outputs[0].token_ids for o in outs]


def test_two_processes_match_single_process_and_report_a_dead_peer(tmp_path):
    """tp=2 x dp=2 over 2 processes x 2 devices: the greedy tokens equal a single-process run of the same mesh
    (the long prompt's chunks in mixed steps: the follower replays those too); then the follower is killed
    mid-request and the leader reports it. (tp=4 over 2 processes is covered through the server:
    tests/test_server_extras.py.)"""
    procs, out = launch(tmp_path, 2, 2, hold=True)
    log = []
    try:
        leader = procs[0]
        deadline = time.monotonic() + 600
        for line in leader.stdout:
            log.append(line)
            if "READY" in line or time.monotonic() > deadline:
                break
        assert "READY" in log[-1], "".join(log)
        killed = time.monotonic()
        procs[1].send_signal(signal.SIGKILL)
        leader.wait(timeout=120)
        elapsed = time.monotonic() - killed
    finally:
        for p in procs:
            p.kill()
    result = json.load(open(out))
    assert result["tokens"] == single_process_tokens(2, 2)
    assert result["mixed_steps"] > 0
    # reported by the peer watchdog or by the collective that lost its peer, whichever comes first: both name it
    assert result["healthy"] is False
    assert "peer process(es) [1] stopped responding" in result["error"], result["error"]
    assert result["request_finish"] == ["error"]
    assert elapsed < 30

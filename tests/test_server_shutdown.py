"""Graceful shutdown on SIGTERM (issue 36): new connections are refused, running requests get --shutdown-timeout
seconds to finish, the rest end with an error (an error event then [DONE] for a stream, a JSON 503 otherwise),
and the process exits 0."""
import json
import signal
import threading
import time

import httpx

from server_proc import ENGINE_FLAGS, ServerProcess, metric


def _start(tiny_model_dir, timeout: float) -> ServerProcess:
    return ServerProcess(["--model", tiny_model_dir, *ENGINE_FLAGS, "--shutdown-timeout", str(timeout)])


def _run_requests(url: str, n_streams: int, n_plain: int, max_tokens: int) -> tuple[list, dict]:
    """Start the requests on threads; returns (threads, results: index -> (stream?, status, body, finished at))."""
    results = {}

    def one(i, stream):
        body = {"prompt": f"Once upon a time {i}", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            results[i] = (stream, r.status_code, r.read().decode(), time.monotonic())

    threads = [threading.Thread(target=one, args=(i, i < n_streams)) for i in range(n_streams + n_plain)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while metric(url, "qwen35:num_requests_running") + metric(url, "qwen35:num_requests_waiting") < len(threads):
        assert time.monotonic() < deadline, "the requests never reached the engine"
        time.sleep(0.02)
    return threads, results


def _events(body: str) -> list:
    """The stream's events, checked to be well formed and to end with [DONE]."""
    chunks = body.split("\n\n")
    assert chunks[-2:] == ["data: [DONE]", ""], body[-300:]
    return [json.loads(c[len("data: "):]) for c in chunks[:-2]]


def _stop(server: ServerProcess) -> float:
    server.proc.send_signal(signal.SIGTERM)
    return time.monotonic()


def test_sigterm_ends_running_requests_after_the_timeout(tiny_model_dir):
    """16 streams and 2 non-streaming requests of 200 tokens against 8 slots, a 1 s shutdown timeout: each stream
    ends with [DONE] (completed, or an error event first), each non-streaming client gets JSON, exit status 0."""
    server = _start(tiny_model_dir, 1)
    try:
        threads, results = _run_requests(server.url, 16, 2, 200)
        sent = _stop(server)
        refused = False
        while time.monotonic() < sent + 3 and not refused:       # the listening socket closes at once
            try:
                httpx.get(server.url + "/health", timeout=1)
                time.sleep(0.05)
            # refused; or accepted in the backlog, then reset or closed without a response
            except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
                refused = True
        assert refused, "the server still accepts connections after SIGTERM"
        for t in threads:
            t.join(timeout=60)
        assert server.proc.wait(timeout=60) == 0, server.tail()
    finally:
        server.stop()
    assert len(results) == 18
    ended = 0
    for i, (stream, status, body, _) in sorted(results.items()):
        if stream:
            assert status == 200, body
            events = _events(body)
            last = events[-1] if events else {}
            if "error" in last:
                assert last["error"]["code"] == "server_shutdown", last
                ended += 1
            else:
                assert last["choices"][0]["finish_reason"] == "length", last
        else:
            out = json.loads(body)
            if status == 503:
                assert out["error"]["code"] == "server_shutdown" and set(out["error"]) == {
                    "message", "type", "param", "code"}, out
                ended += 1
            else:
                assert status == 200 and out["usage"]["completion_tokens"] == 200, (status, body[:300])
    assert ended > 0, "every request finished within 1 s: the test did not exercise the timeout"


def test_sigterm_lets_running_requests_finish(tiny_model_dir):
    """With time enough, every running request completes normally and the process then exits 0 at once."""
    n_streams, n_plain = 6, 2
    server = _start(tiny_model_dir, 60)
    try:
        threads, results = _run_requests(server.url, n_streams, n_plain, 48)
        sent = _stop(server)
        for t in threads:
            t.join(timeout=60)
        assert server.proc.wait(timeout=60) == 0, server.tail()
        exited = time.monotonic()
    finally:
        server.stop()
    assert len(results) == n_streams + n_plain
    assert max(r[3] for r in results.values()) > sent, "everything finished before SIGTERM: nothing was drained"
    assert exited - sent < 30, "the server waited for the timeout although nothing was running"
    for stream, status, body, _ in results.values():
        assert status == 200, body
        if stream:
            events = _events(body)
            assert all("error" not in e for e in events), body[-300:]
            assert events[-1]["choices"][0]["finish_reason"] == "length"
            assert sum(len(e["choices"]) for e in events) >= 1
        else:
            assert json.loads(body)["usage"]["completion_tokens"] == 48

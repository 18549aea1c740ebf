"""The OpenAI-compatible server as a real process on loopback, driven by the official `openai` client (sync and
async) and raw HTTP: chat, completions, streaming, logprobs, seeds, n, stop strings, reasoning split, the bad-input
table, client disconnects, 64 concurrent streams, API-key auth."""
import asyncio
import json
import os

import httpx
import openai
import pytest

from server_proc import API_KEY, ENGINE_FLAGS, ServerProcess, http, metric

MODEL = "tiny"
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


def greedy(**extra):
    return dict(temperature=0, extra_body={"ignore_eos": True, **extra})
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    s = ServerProcess(["--model", tiny_model_dir, "--served-model-name", MODEL, "other-name", "--api-key", API_KEY,
                       "--max-request-body-bytes", "65536", *ENGINE_FLAGS])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from qwen35_jax.engine.tokenizer import Tokenizer
    return Tokenizer(tiny_model_dir)


def post(server, path, body, key=API_KEY, timeout=120):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return http().post(server.url + path, content=data, headers={**headers, "Content-Type": "application/json"},
                       timeout=timeout)


def healthy(server) -> bool:
    return http().get(server.url + "/health").status_code == 200


# -- basics ------------------------------------------------------------------------------------------------------
def test_models_health_metrics_and_auth(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL, "other-name"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}          # open without a key
    assert "qwen35:num_requests_running" in httpx.get(server.url + "/metrics").text
    for key in (None, "wrong-key"):
        r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, key=key)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    # the alias is accepted (and echoed, as vLLM does)
    out = client.completions.create(model="other-name", prompt="Hi", max_tokens=2, **GREEDY)
    assert out.model == "other-name" and out.usage.completion_tokens == 2


def test_completions_text_ids_and_batch(client, tokenizer):
    text = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, **GREEDY)
    c = text.choices[0]
    assert c.finish_reason == "length" and text.usage.completion_tokens == 12 and c.text
    ids = tokenizer.encode("The capital of France is")
    assert text.usage.prompt_tokens == len(ids)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, **GREEDY)
    assert by_ids.choices[0].text == c.text
    batch = client.completions.create(model=MODEL, prompt=["The capital of France is", "Once upon"], max_tokens=12,
                                      **GREEDY)
    assert [x.index for x in batch.choices] == [0, 1] and batch.choices[0].text == c.text
    assert batch.usage.prompt_tokens == len(ids) + len(tokenizer.encode("Once upon"))
    assert batch.usage.completion_tokens == 24


def test_chat_reasoning_split_and_template_kwargs(client, tokenizer):
    """The generation prompt ends inside <think>: everything up to the think-end token is reasoning_content."""
    raw = {}
    for thinking in (True, False):
        prompt = tokenizer.apply_chat_template(CHAT, enable_thinking=thinking)
        ref = client.completions.create(model=MODEL, prompt=tokenizer.encode(prompt), max_tokens=16,
                                        **greedy(return_token_ids=True))
        chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=16,
                                              **greedy(chat_template_kwargs={"enable_thinking": thinking}))
        msg = chat.choices[0].message
        raw[thinking] = (ref.choices[0].text, msg)
        assert chat.usage.prompt_tokens == len(tokenizer.encode(prompt))
        if thinking:
            end = tokenizer.hf.convert_tokens_to_ids("</think>")
            toks = ref.choices[0].token_ids
            if end in toks:
                k = toks.index(end)
                assert msg.reasoning_content == tokenizer.decode(toks[:k])
                assert msg.content == tokenizer.decode(toks[k + 1:]).lstrip("\n")
            else:
                assert (msg.reasoning_content, msg.content) == (ref.choices[0].text, "")
        else:
            assert msg.reasoning_content is None and msg.content == ref.choices[0].text
    # streamed deltas reassemble the same split
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, stream=True, **GREEDY)
    reasoning = content = ""
    for chunk in stream:
        d = chunk.choices[0].delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
    assert (reasoning, content) == (raw[True][1].reasoning_content or "", raw[True][1].content)


def test_streaming_matches_non_streaming(client):
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])
    no_think = greedy(chat_template_kwargs={"enable_thinking": False})
    chat_full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, **no_think)
    chat_chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, stream=True,
                                                      **no_think))
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat_chunks) == chat_full.choices[0].message.content
    assert chat_chunks[-1].choices[0].finish_reason == "length"


def test_sse_wire_format(server):
    with httpx.stream("POST", server.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"prompt": "Hi", "max_tokens": 3, "stream": True, "temperature": 0}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    events = body.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])


def test_logprobs(client):
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, logprobs=True, top_logprobs=3,
                                          **GREEDY)
    items = chat.choices[0].logprobs.content
    assert len(items) == 6
    for it in items:
        tops = [t.logprob for t in it.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and all(x <= 0 for x in tops)
        assert it.logprob == pytest.approx(tops[0], abs=1e-5)          # greedy picks the most likely token
        assert it.bytes == list(it.token.encode())
    cmpl = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, logprobs=2, **GREEDY)
    lp = cmpl.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(2 <= len(t) <= 3 for t in lp.top_logprobs)
    assert lp.token_logprobs[0] == pytest.approx(max(lp.top_logprobs[0].values()), abs=1e-5)
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=5, logprobs=2, stream=True, **GREEDY) if c.choices]
    assert sum((s.token_logprobs for s in streamed if s), []) == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_seed_reproducibility_and_n(client):
    def sample(seed, n=1):
        return client.completions.create(model=MODEL, prompt="Once", max_tokens=12, temperature=1.0, seed=seed, n=n,
                                         extra_body={"ignore_eos": True})
    a, b, c = sample(42), sample(42), sample(7)
    assert a.choices[0].text == b.choices[0].text != c.choices[0].text
    two = sample(42, n=2)
    assert [x.index for x in two.choices] == [0, 1] and two.choices[0].text == a.choices[0].text
    assert two.choices[0].text != two.choices[1].text and two.usage.completion_tokens == 24
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, n=2, temperature=1.0, seed=3,
                                          stream=True, extra_body={"ignore_eos": True})
    texts = {0: "", 1: ""}
    for chunk in chat:
        for ch in chunk.choices:
            texts[ch.index] += (getattr(ch.delta, "reasoning_content", None) or "") + (ch.delta.content or "")
    assert texts[0] and texts[1] and texts[0] != texts[1]


def test_stop_strings(client):
    full = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=24, **GREEDY).choices[0].text
    assert len(full) > 12
    stop = full[6:10]
    for s in (stop, [stop, "never-seen"]):
        out = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=24, stop=s, **GREEDY)
        assert out.choices[0].text == full[:full.find(stop)]
        assert out.choices[0].finish_reason == "stop" and out.choices[0].model_extra["stop_reason"] == stop
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Hello world", max_tokens=24, stop=stop, stream=True, **GREEDY))
    assert streamed == full[:full.find(stop)]


def test_async_client(server):
    async def run():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        one = await c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, **GREEDY)
        stream = await c.completions.create(model=MODEL, prompt="Hi", max_tokens=5, stream=True, **GREEDY)
        parts = [ch.choices[0].text async for ch in stream if ch.choices]
        await c.close()
        return one, parts
    one, parts = asyncio.run(run())
    assert one.usage.completion_tokens == 5 and len("".join(parts)) > 0


# -- bad input ---------------------------------------------------------------------------------------------------
C, CH = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "Hi"}]
BAD = [
    (C, b"{not json", 400, None),
    (C, b"[1, 2]", 400, None),
    (C, {"prompt": "Hi", "max_tokens": "5"}, 400, "max_tokens"),
    (C, {"prompt": "Hi", "stream": 1}, 400, "stream"),
    (C, {"prompt": "Hi", "temperature": -1}, 400, "temperature"),
    (C, {"prompt": "Hi", "top_p": 0}, 400, "top_p"),
    (C, {"prompt": "Hi", "top_k": -5}, 400, "top_k"),
    (C, {"prompt": "Hi", "min_p": 1.5}, 400, "min_p"),
    (C, {"prompt": "Hi", "presence_penalty": 3}, 400, "presence_penalty"),
    (C, {"prompt": "Hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (C, {"prompt": "Hi", "n": 0}, 400, "n"),
    (C, {"prompt": "Hi", "n": 1000}, 400, "n"),
    (C, {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "Hi", "logprobs": 21}, 400, "logprobs"),
    (C, b'{"prompt": "Hi", "temperature": NaN}', 400, "temperature"),
    (C, {"prompt": "Hi", "seed": "x"}, 400, "seed"),
    (C, {"prompt": "Hi", "stop": ["ok", ""]}, 400, "stop"),
    (C, {"prompt": "Hi", "stop": 5}, 400, "stop"),
    (C, {"prompt": "Hi", "model": "no-such-model"}, 404, "model"),
    (C, {"prompt": ""}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": [1, "a"]}, 400, "prompt"),
    (C, {"prompt": [5, 99999]}, 400, "prompt"),
    (C, {"prompt": [-1]}, 400, "prompt"),
    (C, {}, 400, "prompt"),
    (C, {"prompt": [1] * 250, "max_tokens": 10}, 400, "prompt"),
    (C, {"prompt": [1] * 256}, 400, "prompt"),
    (CH, {"messages": MSG, "echo": True}, 400, "echo"),          # echo is a completions field
    (C, {"prompt": "Hi", "suffix": "x"}, 400, "suffix"),
    (C, {"prompt": "Hi", "best_of": 3}, 400, "best_of"),
    (C, {"prompt": "Hi", "logit_bias": {"5": 10}}, 400, "logit_bias"),
    (C, {"prompt": "Hi", "no_such_field": 1}, 400, "no_such_field"),
    (C, {"prompt": "Hi", "stream_options": {"include_usage": True, "x": 1}}, 400, "stream_options.x"),
    (CH, {"messages": []}, 400, "messages"),
    (CH, {"messages": "Hi"}, 400, "messages"),
    (CH, {}, 400, "messages"),
    (CH, {"messages": [{"role": "wizard", "content": "Hi"}]}, 400, "messages.0.role"),
    (CH, {"messages": [{"role": "user"}]}, 400, "messages.0.content"),
    (CH, {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages.0.content"),
    (CH, {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages.0.tool_call_id"),
    (CH, {"messages": MSG, "tools": [{"type": "function", "function": {"name": 5}}]}, 400, "tools.0.function.name"),
    (CH, {"messages": MSG, "tool_choice": "auto"}, 400, "tool_choice"),
    (CH, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "later"},
     400, "tool_choice"),
    (C, {"prompt": "Hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    (CH, {"messages": MSG, "response_format": {"type": "json_schema"}}, 400, "response_format"),
    (C, {"prompt": "Hi", "guided_regex": "a(b"}, 400, "guided_regex"),
    (C, {"prompt": "Hi", "guided_choice": ["a"], "structured_outputs": {"regex": "a"}}, 400, "guided_choice"),
    (C, {"prompt": "Hi", "structured_outputs": {"regex": "a", "bogus": 1}}, 400, "structured_outputs"),
    (CH, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    (CH, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    (CH, {"messages": MSG, "max_tokens": 5, "max_completion_tokens": 6}, 400, "max_tokens"),
    (CH, {"messages": MSG, "max_completion_tokens": 1000}, 400, "messages"),
    (CH, {"messages": MSG, "chat_template_kwargs": {"enable_thinkng": False}}, 400,
     "chat_template_kwargs.enable_thinkng"),
    (CH, {"messages": MSG, "chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs.tokenize"),
    (CH, {"messages": MSG, "model": "gpt-4o"}, 404, "model"),
    (C, b'{"prompt": "' + b"x" * 70000 + b'"}', 413, None),
]


def test_bad_input_table(server):
    """Each bad request gets an OpenAI-shaped 4xx naming the parameter; the server stays healthy after each."""
    for path, body, status, param in BAD:
        r = post(server, path, body)
        assert r.status_code == status, (path, body, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        assert err["param"] == param, (body, err)
        assert healthy(server)
    for path, method in (("/v1/nothing", "GET"), (C, "GET")):
        r = http().request(method, server.url + path, headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code in (404, 405) and "error" in r.json()


def test_bad_input_through_client(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="Hi", temperature=-2)
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(model=MODEL, messages=MSG, tools=[{"type": "function",
                                                                          "function": {"name": "f"}}],
                                       tool_choice={"type": "function", "function": {"name": "g"}})
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSG)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt=[1] * 200, max_tokens=100)


# -- disconnects -------------------------------------------------------------------------------------------------
def _wait_idle(server, timeout=10.0) -> bool:
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(server.url, "qwen35:num_requests_running") == 0 and \
                metric(server.url, "qwen35:num_requests_waiting") == 0:
            return True
        time.sleep(0.05)
    return False


def test_streaming_disconnect_aborts(server):
    assert _wait_idle(server)
    aborted = metric(server.url, "qwen35:request_success_total", finished_reason="abort")
    tokens = metric(server.url, "qwen35:generation_tokens_total")
    body = {"prompt": "Once upon a time", "max_tokens": 200, "stream": True, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 4:
                break
    assert _wait_idle(server), "the aborted stream still holds its slot"
    assert metric(server.url, "qwen35:request_success_total", finished_reason="abort") == aborted + 1
    assert metric(server.url, "qwen35:generation_tokens_total") - tokens < 200
    assert healthy(server)


def test_non_streaming_disconnect_aborts(server):
    """A non-streaming client that hangs up while its request runs: the request is aborted, its slot freed."""
    import socket
    import time
    from urllib.parse import urlparse
    assert _wait_idle(server)
    aborted = metric(server.url, "qwen35:request_success_total", finished_reason="abort")
    tokens = metric(server.url, "qwen35:generation_tokens_total")
    body = json.dumps({"prompt": "Once", "max_tokens": 250, "temperature": 0, "ignore_eos": True}).encode()
    u = urlparse(server.url)
    sock = socket.create_connection((u.hostname, u.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
                 + b"\r\n\r\n" + body)
    deadline = time.monotonic() + 30
    while metric(server.url, "qwen35:num_requests_running") < 1:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.01)
    sock.close()
    assert _wait_idle(server), "the abandoned request still holds its slot"
    assert metric(server.url, "qwen35:request_success_total", finished_reason="abort") == aborted + 1
    assert metric(server.url, "qwen35:generation_tokens_total") - tokens < 250
    assert healthy(server)


# -- load ----------------------------------------------------------------------------------------------------------
def test_64_concurrent_streams(server):
    """64 streams against 8 slots: every one completes with its own tokens, the right usage, nothing lost."""
    prompts = ["Once upon a time", "The capital of France is", "Hello world", "In 1492"]

    async def one(c, i):
        n_tokens = 2 + i % 3
        stream = await c.completions.create(model=MODEL, prompt=prompts[i % 4], max_tokens=n_tokens, stream=True,
                                            stream_options={"include_usage": True}, temperature=0,
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
        text, ids, usage, finish = "", [], None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                text += ch.text
                ids += ch.model_extra["token_ids"]
                finish = ch.finish_reason or finish
        return i, n_tokens, text, ids, usage, finish

    async def run():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
        res = await asyncio.gather(*(one(c, i) for i in range(64)))
        await c.close()
        return res

    results = asyncio.run(run())
    by_prompt = {}
    for i, n_tokens, text, ids, usage, finish in results:
        assert finish == "length" and len(ids) == n_tokens == usage.completion_tokens, (i, ids, usage)
        by_prompt.setdefault(i % 4, []).append((ids, text))
    for group in by_prompt.values():       # greedy: the same prompt gives the same tokens, however batched
        longest = max(group, key=lambda g: len(g[0]))
        assert all(ids == longest[0][:len(ids)] and longest[1].startswith(text) for ids, text in group)
    assert _wait_idle(server) and healthy(server)


def test_metrics_after_traffic(server):
    """Its own traffic (xdist may run the other tests of this module on another worker, with its own server)."""
    before = metric(server.url, "qwen35:request_success_total", finished_reason="length")
    for i in range(3):
        r = post(server, "/v1/completions", {"model": MODEL, "prompt": f"metrics {i}", "max_tokens": 4,
                                             "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
    text = httpx.get(server.url + "/metrics").text
    for name in ("qwen35:time_to_first_token_seconds_count", "qwen35:inter_token_latency_seconds_count",
                 "qwen35:request_queue_time_seconds_count", "qwen35:e2e_request_latency_seconds_count",
                 "qwen35:prompt_tokens_total", "qwen35:generation_tokens_total"):
        assert metric(server.url, name) > 0, name
    for name in ("qwen35:kv_cache_usage_perc", "qwen35:state_slot_usage_perc", "qwen35:num_requests_waiting"):
        assert name in text
    assert metric(server.url, "qwen35:request_success_total", finished_reason="length") >= before + 3
    assert metric(server.url, "qwen35:engine_healthy") == 1


def test_prefix_cache_usage_metrics_and_reset(server, client):
    """The next turn of a conversation resumes from the last one's snapshot: usage says how many prompt tokens
    were cached, /metrics counts them, /reset_prefix_cache drops them."""
    queries, hits = metric(server.url, "qwen35:prefix_cache_queries_total"), \
        metric(server.url, "qwen35:prefix_cache_hits_total")
    turn = [{"role": "user", "content": "Tell me about prefix caches in one sentence."}]
    first = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=8, **GREEDY)
    prompt = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens < prompt
    body = {"model": MODEL, "prompt": [1, 2, 3] * 10, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert post(server, "/v1/completions", body).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    ids = body["prompt"] + post(server, "/v1/completions", {**body, "return_token_ids": True}).json()[
        "choices"][0]["token_ids"] + [5]
    nxt = post(server, "/v1/completions", {**body, "prompt": ids}).json()["usage"]
    assert nxt["prompt_tokens_details"]["cached_tokens"] == 30 + 4 - 1, nxt
    assert metric(server.url, "qwen35:prefix_cache_queries_total") >= queries + prompt + 30
    assert metric(server.url, "qwen35:prefix_cache_hits_total") >= hits + 33
    assert post(server, "/reset_prefix_cache", {}).json() == {"status": "ok"}
    cold = post(server, "/v1/completions", {**body, "prompt": ids}).json()["usage"]
    assert cold["prompt_tokens_details"]["cached_tokens"] == 0


def test_health_fails_when_engine_loop_dies(tiny_model_dir):
    """In-process app over a real engine whose loop has died (as Engine._run records it): /health and new
    requests answer 503, not 200 or 500."""
    from fastapi.testclient import TestClient
    from prometheus_client import CollectorRegistry

    from conftest import engine_args
    from qwen35_jax.llm import LLM
    from qwen35_jax.server.metrics import PrometheusObserver
    from qwen35_jax.server.app import ServerConfig, create_app
    registry = CollectorRegistry()
    llm = LLM(tiny_model_dir, observer=PrometheusObserver(registry, MODEL), **engine_args(precompile=False))
    app = create_app(llm.engine, ServerConfig(served_model_names=[MODEL], model_path=tiny_model_dir), registry)
    with TestClient(app) as c:
        assert c.get("/health").status_code == 200
        assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
        llm.engine.error = RuntimeError("device lost")
        r = c.get("/health")
        assert r.status_code == 503 and "device lost" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert "qwen35:engine_healthy" in c.get("/metrics").text
    llm.shutdown()


@pytest.mark.parametrize("special_tags", [True, False])
def test_reasoning_splitter(tiny_model_dir, tmp_path, special_tags):
    """The split at the think-end token, fed token by token as the engine streams it: with the tags as special
    tokens (dropped from the text, as the tiny tokenizer has them) and as plain added tokens (kept in the text, as
    released Qwen checkpoints have them); reasoning and content only ever grow."""
    import shutil

    from qwen35_jax.server.generation import ReasoningSplitter, think_token_ids
    from qwen35_jax.engine.tokenizer import Tokenizer
    model = tiny_model_dir
    if not special_tags:
        model = str(tmp_path / "tok")
        os.makedirs(model)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(tiny_model_dir, f), model)
        spec = json.load(open(os.path.join(model, "tokenizer.json")))
        for t in spec["added_tokens"]:
            t["special"] = t["special"] and t["content"] not in ("<think>", "</think>")
        json.dump(spec, open(os.path.join(model, "tokenizer.json"), "w"))
    tok = Tokenizer(model)
    ids = think_token_ids(tok)
    start, end = ids
    body, answer = tok.encode("Paris, surely"), tok.encode("\n\nThe capital is Paris.")

    def run(prompt_text, out_ids):
        sp = ReasoningSplitter(tok, ids, tok.encode(prompt_text), skip_special_tokens=True)
        prev = ("", "")
        for k in range(1, len(out_ids) + 1):
            r, c = sp.split(tok.decode(out_ids[:k]), out_ids[:k])
            assert (r or "").startswith(prev[0]) and c.startswith(prev[1])
            prev = (r or "", c)
        return r, c

    thinking = tok.apply_chat_template(CHAT, enable_thinking=True)
    assert thinking.endswith("<think>\n")
    assert run(thinking, body + [end] + answer) == ("Paris, surely", "The capital is Paris.")
    assert run(thinking, body) == ("Paris, surely", "")                       # cut off while thinking
    no_thinking = tok.apply_chat_template(CHAT, enable_thinking=False)
    assert run(no_thinking, answer) == (None, tok.decode(answer))
    plain = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"        # the model opens <think> itself
    assert run(plain, [start] + body + [end] + answer) == ("Paris, surely", "The capital is Paris.")
    assert ReasoningSplitter(tok, None, tok.encode(thinking), True).split("x</think>y", [1, end, 2]) == (None,
                                                                                                        "x</think>y")

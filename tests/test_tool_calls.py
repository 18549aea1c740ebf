"""Tool calling (Qwen3.5's XML format): the parser, its streaming form under every chunking, the request checks,
the chat template's rendering of a tool round trip against HF transformers, and the server's chat path end to end
through the `openai` SDK (an in-process app over a real engine whose completion text is scripted, since the tiny
models never call tools by themselves)."""
import dataclasses
import json

import openai
import pytest

from qwen35_jax.server.tool_calls import (
    ToolCallStreamer,
    ToolRequestError,
    check_tool_choice,
    check_tools,
    message_tool_fields,
    parse_tool_calls,
)

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "celsius": {"type": "boolean"},
            "scale": {"type": "number"}, "opts": {"type": "object"}, "tags": {"type": "array"},
            "note": {"type": ["string", "null"]}, "code": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]


def block(name, **params) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def calls_of(calls):
    """(name, arguments) of OpenAI tool calls; the ids are random."""
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


WEATHER = block("get_weather", city="Paris", days="3")
NOW = block("now")


# -- the parser ----------------------------------------------------------------------------------------------------
def test_single_call():
    content, calls = parse_tool_calls(WEATHER, TOOLS)
    assert content is None and calls_of(calls) == [("get_weather", {"city": "Paris", "days": 3})]
    assert calls[0]["function"]["arguments"] == '{"city": "Paris", "days": 3}'


def test_prose_before_and_parallel_calls():
    text = "Let me check both.\n\n" + WEATHER + "\n" + NOW
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "Let me check both."
    assert calls_of(calls) == [("get_weather", {"city": "Paris", "days": 3}), ("now", {})]
    assert len({c["id"] for c in calls}) == 2
    content, calls = parse_tool_calls(text, TOOLS, parallel=False)
    assert content == "Let me check both." and calls_of(calls) == [("get_weather", {"city": "Paris", "days": 3})]


def test_typed_parameters_by_schema():
    text = block("get_weather", city="42", days="7", celsius="true", scale="1.5", opts='{"a": [1, {"b": null}]}',
                 tags='["x", 2]', note="null", code='{"not": "parsed"}')
    (_, args), = calls_of(parse_tool_calls(text, TOOLS)[1])
    assert args == {"city": "42", "days": 7, "celsius": True, "scale": 1.5, "opts": {"a": [1, {"b": None}]},
                    "tags": ["x", 2], "note": "null", "code": '{"not": "parsed"}'}
    # a value that does not parse as its type stays text
    (_, args), = calls_of(parse_tool_calls(block("get_weather", days="three", celsius="yes", opts="{bad"), TOOLS)[1])
    assert args == {"days": "three", "celsius": "yes", "opts": "{bad"}


def test_unknown_function_and_parameter_kept_as_text():
    text = block("get_weather", city="Rome", wind="12") + block("teleport", to="Mars", n="5")
    assert calls_of(parse_tool_calls(text, TOOLS)[1]) == [("get_weather", {"city": "Rome", "wind": "12"}),
                                                          ("teleport", {"to": "Mars", "n": "5"})]
    assert calls_of(parse_tool_calls(text, None)[1])[0] == ("get_weather", {"city": "Rome", "wind": "12"})


def test_multiline_string_values():
    code = "def f(x):\n    return x < 2 and '<tag>'\n\n\nprint(f(1))"
    (_, args), = calls_of(parse_tool_calls(block("get_weather", city="  spaced  ", code=code), TOOLS)[1])
    assert args == {"city": "  spaced  ", "code": code}
    # exactly one newline is stripped on each side, as the template writes them
    raw = "<tool_call>\n<function=get_weather>\n<parameter=city>\n\nA\n\n</parameter>\n</function>\n</tool_call>"
    assert calls_of(parse_tool_calls(raw, TOOLS)[1]) == [("get_weather", {"city": "\nA\n"})]


def test_no_calls_leaves_text_unchanged():
    for text in ("", "plain answer\n\n", "about <tool_call> tags", "x <tool", "<tool_call>\n<function=now>\n"):
        assert parse_tool_calls(text, TOOLS) == (text, [])


def test_truncated_and_malformed_blocks_stay_content():
    cut = "Checking.\n\n" + WEATHER[:-len("</tool_call>") + 3]
    assert parse_tool_calls(cut, TOOLS) == (cut, [])
    content, calls = parse_tool_calls(WEATHER + "\n" + NOW[:20], TOOLS)
    assert calls_of(calls) == [("get_weather", {"city": "Paris", "days": 3})] and content == NOW[:20]
    for bad in ("<tool_call>\nno function here\n</tool_call>",
                "<tool_call>\n<function=now>\nstray text\n</function>\n</tool_call>",
                "<tool_call>\n<function=>\n</function>\n</tool_call>"):
        assert parse_tool_calls("Hi\n" + bad, TOOLS) == ("Hi\n" + bad, [])
    content, calls = parse_tool_calls("<tool_call>\nnope\n</tool_call>" + NOW, TOOLS)
    assert content == "<tool_call>\nnope\n</tool_call>" and calls_of(calls) == [("now", {})]


STREAM_CASES = [
    "Let me check both.\n\n" + WEATHER + "\n" + NOW,
    WEATHER,
    "no calls at all, just <tool text\n",
    "Checking.\n\n" + WEATHER[:-5],
    "a\n" + "<tool_call>\nbad\n</tool_call>" + "\n" + block("now") + "\ntrailing words\n",
    block("get_weather", code="x\n</parameter\nstill <tool_call inside") + "  \n",
]


def stream(text, cuts, tools=TOOLS, parallel=True):
    s = ToolCallStreamer(tools, parallel)
    content, calls = "", []
    for k in cuts:
        new, done = s.feed(text[:k], final=k == len(text))
        content += new
        calls += done
    return content, calls


@pytest.mark.parametrize("text", STREAM_CASES)
def test_streaming_every_split_point(text):
    """Cumulative text fed in two pieces at every split point, and one character at a time, gives the same content
    and calls as the whole text; content never holds the XML of a call that parsed."""
    want_content, want_calls = parse_tool_calls(text, TOOLS)
    want = (want_content or "", calls_of(want_calls))
    for k in range(len(text) + 1):
        content, calls = stream(text, [k, len(text)])
        assert (content, calls_of(calls)) == want, k
    content, calls = stream(text, range(1, len(text) + 1))
    assert (content, calls_of(calls)) == want
    if want_calls:
        assert "<function=" not in content or "bad" in content


def test_streaming_sends_prose_early_and_calls_when_complete():
    text = "Let me check.\n\n" + WEATHER + "\n" + NOW
    s = ToolCallStreamer(TOOLS)
    assert s.feed("Let me check.\n\n<tool") == ("Let me check.", [])        # the partial tag is held back
    assert s.feed(text[:len("Let me check.\n\n") + len(WEATHER) - 1]) == ("", [])
    new, calls = s.feed(text[:len("Let me check.\n\n") + len(WEATHER)])
    assert new == "" and calls_of(calls) == [("get_weather", {"city": "Paris", "days": 3})]
    new, calls = s.feed(text, final=True)
    assert new == "" and calls_of(calls) == [("now", {})]
    assert stream(text, [len(text)], parallel=False)[1][0]["function"]["name"] == "get_weather"
    assert len(stream(text, range(1, len(text) + 1), parallel=False)[1]) == 1


# -- request checks ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tools,param", [
    ([], "tools"), ({"type": "function"}, "tools"), ([{"type": "retrieval"}], "tools.0.type"),
    ([{"type": "function"}], "tools.0.function"), ([{"type": "function", "function": {}}], "tools.0.function.name"),
    ([{"type": "function", "function": {"name": "a b"}}], "tools.0.function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
     "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], "tools.0.function.strict"),
    ([{"type": "function", "function": {"name": "f", "parameter": {}}}], "tools.0.function.parameter"),
    ([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}],
     "tools.1.function.name"),
])
def test_check_tools_refuses(tools, param):
    with pytest.raises(ToolRequestError) as e:
        check_tools(tools)
    assert e.value.param == param


def test_tool_choice_and_message_fields():
    assert check_tools(TOOLS) is TOOLS
    assert check_tool_choice(None, TOOLS) == check_tool_choice("auto", TOOLS) == (True, None)
    assert check_tool_choice("none", TOOLS) == check_tool_choice(None, None) == check_tool_choice("none", None) == \
        (False, None)
    assert check_tool_choice("required", TOOLS) == (True, "required")
    assert check_tool_choice({"type": "function", "function": {"name": "now"}}, TOOLS) == (True, "now")
    for choice, tools in (("auto", None), ("required", None), ("sometimes", TOOLS), (1, TOOLS),
                          ({"type": "function", "function": {"name": "later"}}, TOOLS)):
        with pytest.raises(ToolRequestError):
            check_tool_choice(choice, tools)
    call = {"id": "c1", "type": "function", "function": {"name": "now", "arguments": '{"a": 1}'}}
    assert message_tool_fields({"tool_calls": [call]}, "assistant", "m") == {
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "now", "arguments": {"a": 1}}}]}
    assert message_tool_fields({"tool_call_id": "c1"}, "tool", "m") == {"tool_call_id": "c1"}
    for m, role, param in (({"tool_calls": [call]}, "user", "m.tool_calls"), ({}, "tool", "m.tool_call_id"),
                           ({"tool_call_id": "c1"}, "user", "m.tool_call_id"),
                           ({"tool_calls": [{**call, "function": {"name": "now", "arguments": "[1]"}}]},
                            "assistant", "m.tool_calls.0.function.arguments"),
                           ({"tool_calls": [{**call, "function": {"name": "now", "arguments": "{x"}}]},
                            "assistant", "m.tool_calls.0.function.arguments"),
                           ({"tool_calls": [{"function": {"name": "now"}}]}, "assistant", "m.tool_calls.0")):
        with pytest.raises(ToolRequestError) as e:
            message_tool_fields(m, role, "m")
        assert e.value.param == param


# -- template rendering --------------------------------------------------------------------------------------------
ROUND_TRIP = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris for 3 days, and the time?"},
    {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3, "opts": {"u": "C"}}'}},
        {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": {}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
]


def test_template_round_trip_matches_transformers():
    """The server's messages (JSON-string arguments become objects) rendered through the project's tokenizer equal
    transformers' apply_chat_template of the same conversation on the default model's tokenizer, and the rendered
    assistant call parses back into the same call."""
    from transformers import AutoTokenizer

    from qwen35_jax.engine.tokenizer import Tokenizer
    from qwen35_jax.model.hub import default_model_dir
    from qwen35_jax.server.protocol import chat_messages
    model = default_model_dir()
    ours = Tokenizer(model)
    hf = AutoTokenizer.from_pretrained(model)
    hf_messages = json.loads(json.dumps(ROUND_TRIP))
    for m in hf_messages:
        for c in m.get("tool_calls", ()):
            if isinstance(c["function"]["arguments"], str):
                c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    text = ours.apply_chat_template(chat_messages(ROUND_TRIP), tools=TOOLS)
    want = hf.apply_chat_template(hf_messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text == want
    assert ours.encode(text) == hf.encode(want, add_special_tokens=False)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert "<tool_response>\nsunny, 21C\n</tool_response>\n<tool_response>\n12:00\n</tool_response>" in text
    ids = ours.encode(text)
    assert ids.count(ours.hf.convert_tokens_to_ids("<tool_call>")) == 2 + 2     # two calls, two in the instructions
    turn = text.split("<|im_start|>assistant\n<think>\n\n</think>\n\n")[1].split("<|im_end|>")[0]
    content, calls = parse_tool_calls(turn, TOOLS)
    assert content == "Let me check."
    assert calls_of(calls) == [("get_weather", {"city": "Paris", "days": 3, "opts": {"u": "C"}}), ("now", {})]


def test_llm_chat_renders_tools(tiny_model_dir):
    """LLM.chat passes tools and tool history to the template (JSON-string arguments accepted); no engine needed
    to check the prompt, so the rendering is checked on an LLM whose engine is never started."""
    from qwen35_jax.engine.tokenizer import Tokenizer
    from qwen35_jax.llm import LLM
    llm = LLM.__new__(LLM)
    llm.tokenizer = Tokenizer(tiny_model_dir)
    seen = []
    llm.generate = lambda prompts, params, use_tqdm: seen.extend(prompts)
    llm.chat(ROUND_TRIP, tools=TOOLS)
    from qwen35_jax.server.protocol import chat_messages
    assert seen[0]["prompt"] == llm.tokenizer.apply_chat_template(chat_messages(ROUND_TRIP), tools=TOOLS)
    with pytest.raises(ValueError, match="tools.0.type"):
        llm.chat(ROUND_TRIP, tools=[{"type": "web"}])
    bad = [*ROUND_TRIP[:2], {"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "now", "arguments": "{oops"}}]}]
    with pytest.raises(ValueError, match="messages.2.tool_calls.0.function.arguments"):
        llm.chat(bad, tools=TOOLS)


# -- the server, end to end ------------------------------------------------------------------------------------------
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
SCRIPT = "The user wants the weather.</think>\n\nLet me check.\n\n" + WEATHER + "\n" + NOW


@pytest.fixture(scope="module")
def app_engine(tiny_model_dir):
    from fastapi.testclient import TestClient
    from prometheus_client import CollectorRegistry

    from conftest import engine_args
    from qwen35_jax.llm import LLM
    from qwen35_jax.server.app import ServerConfig, create_app
    from qwen35_jax.server.metrics import PrometheusObserver
    registry = CollectorRegistry()
    # the tools' instructions make a long prompt (~770 tokens with the tiny tokenizer)
    llm = LLM(tiny_model_dir, observer=PrometheusObserver(registry, "tiny"),
              **engine_args(precompile=False, max_model_len=1024))
    app = create_app(llm.engine, ServerConfig(served_model_names=["tiny"], model_path=tiny_model_dir), registry)
    with TestClient(app) as http:
        yield http, llm.engine, llm
    llm.shutdown()


@pytest.fixture()
def client(app_engine):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=app_engine[0], max_retries=0)


@pytest.fixture()
def scripted(app_engine, monkeypatch):
    """The engine really runs each request (max_tokens = the script's length, ignore_eos), but its outputs carry
    the script's first k tokens when it has made k, and finish as `finish` when it ends."""
    engine = app_engine[1]
    tok, real = engine.tokenizer, engine.add_request

    def use(text: str, finish: str = "stop") -> int:
        ids = tok.encode(text)

        def add_request(prompt, params, callback, rid, matchers=None):
            def forward(out):
                outs = []
                for o in out.outputs:
                    k = min(len(o.token_ids), len(ids))
                    done = finish if o.finish_reason is not None else None
                    outs.append(dataclasses.replace(o, text=tok.decode(ids[:k]), token_ids=ids[:k],
                                                    finish_reason=done, stop_reason=None))
                callback(dataclasses.replace(out, outputs=outs))
            return real(prompt, params, forward, rid, matchers=matchers)

        monkeypatch.setattr(engine, "add_request", add_request)
        return len(ids)
    return use


def test_server_renders_tools_into_the_prompt(client, app_engine):
    """A real generation with tools: the request succeeds and its prompt is the template's rendering with tools."""
    tok = app_engine[1].tokenizer
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="auto",
                                         max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    with_tools = len(tok.encode(tok.apply_chat_template(MESSAGES, tools=TOOLS)))
    assert out.usage.prompt_tokens == with_tools > len(tok.encode(tok.apply_chat_template(MESSAGES)))
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3
    history = client.chat.completions.create(model="tiny", messages=ROUND_TRIP, tools=TOOLS, max_tokens=1)
    from qwen35_jax.server.protocol import chat_messages
    want = tok.apply_chat_template(chat_messages(ROUND_TRIP), tools=TOOLS)
    assert history.usage.prompt_tokens == len(tok.encode(want))


def test_server_tool_calls(client, scripted):
    n = scripted(SCRIPT)
    args = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=n, extra_body={"ignore_eos": True})
    out = client.chat.completions.create(**args)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert choice.message.reasoning_content == "The user wants the weather."
    got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert got == [("get_weather", {"city": "Paris", "days": 3}), ("now", {})]
    assert all(c.type == "function" and c.id.startswith("call_") for c in choice.message.tool_calls)

    content, reasoning, calls, finish = "", "", {}, []
    for chunk in client.chat.completions.create(**args, stream=True):
        d = chunk.choices[0].delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or ""
        for tc in d.tool_calls or ():
            c = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            c["name"] += tc.function.name or ""
            c["arguments"] += tc.function.arguments or ""
        finish.append(chunk.choices[0].finish_reason)
        assert "<tool_call>" not in (d.content or "") and "<function=" not in (d.content or "")
    assert content == "Let me check." and reasoning == "The user wants the weather."
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == got
    assert finish[-1] == "tool_calls" and set(finish[:-1]) == {None}

    one = client.chat.completions.create(**args, parallel_tool_calls=False)
    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["get_weather"]
    # tool_choice "none": the tools are rendered but the completion is not parsed
    raw = client.chat.completions.create(**args, tool_choice="none")
    assert raw.choices[0].message.tool_calls is None and raw.choices[0].finish_reason == "stop"
    assert raw.choices[0].message.content == SCRIPT.split("</think>\n\n")[1]
    assert raw.usage.prompt_tokens == out.usage.prompt_tokens


def test_server_truncated_call_is_content(client, scripted):
    text = "</think>\n\n" + WEATHER[:-12]
    n = scripted(text, finish="length")
    args = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=n, extra_body={"ignore_eos": True})
    out = client.chat.completions.create(**args)
    assert out.choices[0].finish_reason == "length" and out.choices[0].message.tool_calls is None
    assert out.choices[0].message.content == WEATHER[:-12]
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == WEATHER[:-12]
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("extra,param,match", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "later"}}},
     "tool_choice.function.name", "not among the tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "now"}}, "tool_choice", "must be"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "send one"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "nonsense"}}}}}], "tool_choice": "required"},
     "tool_choice", "invalid grammar"),
    ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": 5}}]}, "tools.0.function.name", "name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools.0.function.parameters", "JSON-schema object"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "bool"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "x"}]},
     "messages.1.tool_call_id", "tool_call_id"),
    ({"messages": [{"role": "assistant", "content": None,
                    "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{"}}]}]},
     "messages.0.tool_calls.0.function.arguments", "not valid JSON"),
])
def test_server_refuses(app_engine, extra, param, match):
    r = app_engine[0].post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and match in err["message"], err


def test_completions_still_refuse_tools(app_engine):
    r = app_engine[0].post("/v1/completions", json={"prompt": "Hi", "tools": TOOLS})
    assert r.status_code == 400 and "only supported on /v1/chat/completions" in r.json()["error"]["message"]


# bounded parameters: a random-weight model must still finish each call (the grammar alone makes it a call)
FORCED = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1,
                                                                         "maximum": 7}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_server_tool_choice_always_calls(client, choice):
    # one call each (parallel calls would let a random model go on calling until max_tokens)
    args = dict(model="tiny", messages=MESSAGES, tools=FORCED, tool_choice=choice, max_tokens=120, temperature=1.0,
                n=4, seed=3, parallel_tool_calls=False, extra_body=NO_THINKING)
    out = client.chat.completions.create(**args)
    for c in out.choices:
        calls = calls_of([call.model_dump() for call in c.message.tool_calls])
        assert c.finish_reason == "tool_calls" and len(calls) == 1
        for name, arguments in calls:
            assert name == "get_weather" if isinstance(choice, dict) else name in ("get_weather", "now")
            if name == "get_weather":
                assert arguments["city"] in ("Paris", "Oslo") and 1 <= arguments["days"] <= 7
    streamed = list(client.chat.completions.create(**args, stream=True))
    by_choice = {}
    for chunk in streamed:
        for c in chunk.choices:
            by_choice.setdefault(c.index, []).extend(c.delta.tool_calls or [])
            if c.finish_reason:
                assert c.finish_reason == "tool_calls"
    assert sorted(by_choice) == [0, 1, 2, 3] and all(by_choice.values())


@pytest.mark.parametrize("stream", [False, True])
def test_server_forced_call_round_trip(client, stream):
    """call (forced) -> the tool's result -> an answer, each turn streamed or not."""
    args = dict(model="tiny", tools=FORCED, max_tokens=120, seed=1, stream=stream, extra_body=NO_THINKING)
    first = client.chat.completions.create(messages=MESSAGES, tool_choice="required", parallel_tool_calls=False,
                                           **args)
    if stream:
        deltas = [c.choices[0].delta for c in first if c.choices]
        calls = [call.model_dump(exclude_none=True) for d in deltas for call in d.tool_calls or []]
        message = {"role": "assistant", "content": None,
                   "tool_calls": [{k: v for k, v in call.items() if k != "index"} for call in calls]}
    else:
        message = first.choices[0].message.model_dump(exclude_none=True)
    assert len(message["tool_calls"]) == 1 and message["tool_calls"][0]["function"]["name"] in ("get_weather", "now")
    history = MESSAGES + [message] + [
        {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": '{"temperature": 21}'}]
    answer = client.chat.completions.create(messages=history, tool_choice="none", **{**args, "max_tokens": 8})
    if stream:
        chunks = [c for c in answer if c.choices]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert text and not any(c.choices[0].delta.tool_calls for c in chunks)
    else:
        assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content


def test_forced_call_grammar_lets_the_model_reason_first(app_engine):
    """With thinking on the prompt opens <think>: the grammar allows free reasoning up to </think>, then the call."""
    from qwen35_jax.server.app import chat_constraint
    http, engine, _ = app_engine
    state = http.app.state
    tok = engine.tokenizer
    ids = tok.encode(tok.apply_chat_template(MESSAGES, tools=FORCED))
    spec, field = chat_constraint(state, ids, None, None, FORCED, "required", True)
    assert field == "tool_choice"
    matcher = engine.grammar(spec)
    answer = "I should call it.\n</think>\n\n" + block("get_weather", city="Oslo", days=3)
    assert matcher.consume_tokens(tok.encode(answer)) and matcher.is_accepting()
    matcher = engine.grammar(spec)
    assert not matcher.consume_tokens(tok.encode("No call.\n</think>\n\nIt is sunny."))


def test_llm_chat_tool_choice(app_engine):
    from qwen35_jax.engine.sampling_params import SamplingParams
    llm = app_engine[2]
    sp = SamplingParams(max_tokens=120, temperature=1.0, seed=2, n=2)
    outs = llm.chat(MESSAGES, sp, chat_template_kwargs={"enable_thinking": False}, tools=FORCED,
                    tool_choice={"type": "function", "function": {"name": "now"}}, parallel_tool_calls=False)
    for c in outs[0].outputs:
        content, calls = parse_tool_calls(c.text, FORCED)
        assert [call["function"]["name"] for call in calls] == ["now"] and content is None or content == ""
    with pytest.raises(ToolRequestError, match="not among the tools"):
        llm.chat(MESSAGES, sp, tools=FORCED, tool_choice={"type": "function", "function": {"name": "later"}})

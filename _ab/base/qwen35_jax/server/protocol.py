"""OpenAI request schemas for the server, and their translation into SamplingParams.

Policy: every field a request may carry is declared here. A field we know but do not implement (logit_bias,
tools outside chat, ...) is refused with a 400 naming it unless its value asks for nothing (null, false,
empty, or the neutral choice such as tool_choice "none"); any other field is refused as unknown. Types are checked
strictly (no "5" for 5, no true for 1, no NaN), values by SamplingParams, so nothing is silently ignored or coerced.
"""
from __future__ import annotations

import json
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from qwen35_jax.engine.sampling_params import SamplingParams, StructuredOutputsParams
from qwen35_jax.server.tool_calls import ToolRequestError, check_tool_choice, check_tools, message_tool_fields

MAX_STOP_STRINGS = 16
MAX_SEQUENCES_PER_REQUEST = 256      # n × number of prompts: bounds the work one HTTP request can queue
MAX_JSON_DEPTH = 64                  # nesting a request body may have (no request needs more)


class APIError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


# -- schemas -----------------------------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's, then vLLM's extras)."""
    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: Any = None                       # a string or a list of strings (checked in stop_list)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None                # an end-user id for the caller's own tracking; generation never reads it
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    return_token_ids: bool = False         # also return prompt_token_ids and each choice's token_ids
    prompt_logprobs: int | None = None     # per prompt token its logprob and the top k (not with stream)
    # structured outputs (one of them; `constraint` reads them): OpenAI's, vLLM's, vLLM's older names
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None


class CompletionRequest(_GenerationRequest):
    prompt: Any                            # str | list[str] | list[int] | list[list[int]] (checked in prompts)
    logprobs: int | None = None
    echo: bool = False                     # prepend the prompt to each choice's text (and its logprobs)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[dict]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Any = None                      # checked in tool_calls.check_tools
    tool_choice: Any = None                # tool_calls.check_tool_choice
    parallel_tool_calls: bool | None = None


# Known OpenAI/vLLM fields this server does not implement, with the value(s) that request nothing.
def _neutral(key: str, value, body: dict) -> bool:
    if value is None or value is False or value == [] or value == {}:
        return True
    if key == "tool_choice":
        return value == "none"
    if key == "modalities":
        return value == ["text"]
    if key == "best_of":
        return isinstance(value, int) and not isinstance(value, bool) and value == body.get("n", 1)
    return False


UNSUPPORTED = {
    "tools": "tool calling is only supported on /v1/chat/completions",
    "tool_choice": "tool calling is only supported on /v1/chat/completions",
    "parallel_tool_calls": "tool calling is only supported on /v1/chat/completions",
    "functions": "legacy function calling is not supported (use tools)",
    "function_call": "legacy function calling is not supported (use tool_choice)",
    "logit_bias": "logit_bias is not supported", "allowed_token_ids": "allowed_token_ids is not supported",
    "bad_words": "bad_words is not supported",
    "audio": "audio output is not supported", "modalities": "only the text modality is supported",
    "prediction": "predicted outputs are not supported", "reasoning_effort": "reasoning_effort is not supported",
    "web_search_options": "web search is not supported", "store": "stored completions are not supported",
    "metadata": "metadata (stored completions) is not supported", "service_tier": "service_tier is not supported",
    "verbosity": "verbosity is not supported",
    "echo": "echo is only supported on /v1/completions", "suffix": "suffix (insertion) is not supported",
    "best_of": "best_of different from n is not supported", "use_beam_search": "beam search is not supported",
    "continue_final_message": "continue_final_message is not supported",
    "add_generation_prompt": "add_generation_prompt is not supported (the generation prompt is always added)",
}


def parse(model: type[_Strict], body: dict):
    """Validate a decoded JSON body; any problem becomes a 400 naming the offending parameter."""
    for key, value in body.items():
        if key in UNSUPPORTED and key not in model.model_fields and not _neutral(key, value, body):
            raise bad_request(f"{key}: {UNSUPPORTED[key]}", param=key, code="unsupported_parameter")
    body = {k: v for k, v in body.items() if not (k in UNSUPPORTED and k not in model.model_fields)}
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            raise bad_request(f"unknown parameter {param!r}", param=param, code="unknown_parameter") from None
        if err["type"] == "missing":
            raise bad_request(f"{param} is required", param=param) from None
        raise bad_request(f"{param}: {err['msg']} (got {_short(err.get('input'))})", param=param) from None


def check_json(obj) -> None:
    """Refuse what JSON decodes but nothing downstream can take, naming the field: lone UTF-16 surrogates (the
    tokenizer raises on them), integers beyond 64 bits, non-finite numbers (NaN, Infinity, 1e400), nesting deeper
    than MAX_JSON_DEPTH (recursive code further on would overflow). Iterative, so depth itself is no risk."""
    stack = [(obj, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        where = path or "request body"
        if isinstance(value, str):
            if not value.isascii() and not _encodable(value):
                raise bad_request(f"{where}: contains a lone UTF-16 surrogate (\\ud800-\\udfff); send valid "
                                  f"Unicode", param=path or None, code="invalid_unicode")
        elif isinstance(value, bool) or value is None:
            continue
        elif isinstance(value, int):
            if not -2**63 <= value < 2**63:
                raise bad_request(f"{where}: integer out of range (must fit in 64 bits)", param=path or None)
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise bad_request(f"{where}: must be a finite number (got {_short(value)})", param=path or None)
        elif isinstance(value, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise bad_request(f"request body is nested more than {MAX_JSON_DEPTH} levels deep",
                                  code="invalid_json")
            if isinstance(value, list) and all(type(x) is int for x in value):      # token ids: no per-item loop
                if value and not (-2**63 <= min(value) and max(value) < 2**63):
                    raise bad_request(f"{where}: integer out of range (must fit in 64 bits)", param=path or None)
                continue
            for k, v in (value.items() if isinstance(value, dict) else enumerate(value)):
                key = f"{path}.{k}" if path else str(k)
                if isinstance(k, str) and not k.isascii() and not _encodable(k):
                    raise bad_request(f"{where}: a key contains a lone UTF-16 surrogate", param=path or None,
                                      code="invalid_unicode")
                stack.append((v, key, depth + 1))


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _short(value) -> str:
    s = json.dumps(value) if isinstance(value, (dict, list, str, int, float, bool, type(None))) else repr(value)
    return s if len(s) <= 60 else s[:57] + "..."


def chat_tools(req: ChatCompletionRequest) -> tuple[list[dict] | None, bool, bool, str | None]:
    """(tools to render or None, whether the completion is parsed for calls, parallel calls allowed, the calls the
    completion must make: "required", a function's name, or None)."""
    try:
        tools = check_tools(req.tools) if req.tools not in (None, []) else None
        parse_calls, must = check_tool_choice(req.tool_choice, tools)
    except ToolRequestError as e:
        raise bad_request(str(e), param=e.param, code="unsupported_parameter" if "not supported" in str(e)
                          else None) from None
    return tools, parse_calls, req.parallel_tool_calls is not False, must


def constraint(req: _GenerationRequest) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's structured-output constraint and the field that asked for it: `response_format` (OpenAI:
    json_object, json_schema), `structured_outputs` (vLLM: json, regex, choice, grammar, json_object) or vLLM's
    older guided_json / guided_regex / guided_choice / guided_grammar. At most one of them."""
    asked = []
    rf = req.response_format
    if rf is not None and rf != {"type": "text"}:
        kind = rf.get("type") if isinstance(rf, dict) else None
        spec = rf.get("json_schema") if isinstance(rf, dict) else None
        if kind == "json_object" and set(rf) == {"type"}:
            asked.append(("response_format", {"json_object": True}))
        elif kind == "json_schema" and set(rf) == {"type", "json_schema"} and isinstance(spec, dict) \
                and isinstance(spec.get("schema"), dict) and isinstance(spec.get("name", ""), str) \
                and set(spec) <= {"name", "schema", "strict", "description"}:
            asked.append(("response_format", {"json": spec["schema"]}))
        else:
            raise bad_request('response_format must be {"type": "text"}, {"type": "json_object"} or {"type": '
                              '"json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}, got '
                              f"{_short(rf)}", param="response_format")
    if req.structured_outputs is not None:
        if not isinstance(req.structured_outputs, dict):
            raise bad_request("structured_outputs must be an object", param="structured_outputs")
        asked.append(("structured_outputs", req.structured_outputs))
    for name in ("json", "regex", "choice", "grammar"):
        if getattr(req, f"guided_{name}") is not None:
            asked.append((f"guided_{name}", {name: getattr(req, f"guided_{name}")}))
    if len(asked) > 1:
        raise bad_request(f"send one structured-output field, not {' and '.join(f for f, _ in asked)}",
                          param=asked[1][0])
    if not asked:
        return None, None
    field, fields = asked[0]
    try:
        return StructuredOutputsParams(**fields), field
    except TypeError:
        unknown = sorted(set(fields) - {f for f in StructuredOutputsParams.__dataclass_fields__})
        raise bad_request(f"{field}: unknown field {unknown[0]!r}", param=field) from None
    except ValueError as e:
        raise bad_request(f"{field}: {e}", param=field) from None


def stop_list(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("stop must be a non-empty string or a list of non-empty strings", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stops)}", param="stop")
    return stops


def prompts(prompt) -> list[str | list[int]]:
    """/v1/completions `prompt`: a string, a list of strings, a list of token ids, or a list of those lists."""
    def is_ids(x):
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
    if isinstance(prompt, str):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        items = list(prompt)
    elif isinstance(prompt, list) and prompt and is_ids(prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(is_ids(p) for p in prompt):
        items = list(prompt)
    else:
        raise bad_request("prompt must be a non-empty string, a list of strings, a list of token ids, or a list of "
                          "token-id lists", param="prompt")
    if any(len(p) == 0 for p in items):
        raise bad_request("prompt is empty", param="prompt")
    return items


def chat_messages(messages: list[dict]) -> list[dict]:
    """Check roles and content; text content parts are joined (the templates take a string). Tool fields
    (an assistant's tool_calls, a tool message's tool_call_id) are checked by tool_calls.message_tool_fields."""
    if not messages:
        raise bad_request("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        extra = set(m) - {"role", "content", "reasoning_content", "tool_calls", "tool_call_id"}
        if extra:
            key = sorted(extra)[0]
            why = "legacy function calling is not supported (use tool_calls)" if key == "function_call" \
                else "unknown message field"
            raise bad_request(f"{where}.{key}: {why}", param=f"{where}.{key}")
        role = m.get("role")
        role = "system" if role == "developer" else role        # OpenAI's newer name for system, as vLLM maps it
        if role not in ("system", "user", "assistant", "tool"):
            raise bad_request(f"{where}.role must be 'system', 'user', 'assistant' or 'tool', got {_short(role)}",
                              param=f"{where}.role")
        try:
            tool_fields = message_tool_fields(m, role, where)
        except ToolRequestError as e:
            raise bad_request(str(e), param=e.param) from None
        content = m.get("content")
        if content is None and "tool_calls" in tool_fields:
            content = ""
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str) \
                        or set(part) != {"type", "text"}:
                    raise bad_request(f"{where}.content.{j}: only text parts {{\"type\": \"text\", \"text\": ...}} "
                                      f"are supported", param=f"{where}.content")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise bad_request(f"{where}.content must be a string or a list of text parts", param=f"{where}.content")
        msg = {"role": role, "content": content}
        if m.get("reasoning_content") is not None:
            if role != "assistant" or not isinstance(m["reasoning_content"], str):
                raise bad_request(f"{where}.reasoning_content must be a string on an assistant message",
                                  param=f"{where}.reasoning_content")
            msg["reasoning_content"] = m["reasoning_content"]
        out.append(msg | tool_fields)
    return out


# -- sampling ----------------------------------------------------------------------------------------------------
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def load_generation_defaults(model_dir: str) -> dict:
    """vLLM's `--generation-config auto`: the model's recommended sampling settings from generation_config.json,
    used for the fields a request leaves out."""
    import os
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        cfg = json.load(f)
    return {k: cfg[k] for k in SAMPLING_DEFAULT_KEYS if cfg.get(k) is not None}


def sampling_params(req: _GenerationRequest, *, max_tokens: int, logprobs: int | None,
                    defaults: dict, prompt_logprobs: int | None = None,
                    structured: StructuredOutputsParams | None = None) -> SamplingParams:
    def pick(name, fallback):
        value = getattr(req, name)
        return value if value is not None else defaults.get(name, fallback)
    if req.n > MAX_SEQUENCES_PER_REQUEST:
        raise bad_request(f"n must be <= {MAX_SEQUENCES_PER_REQUEST}, got {req.n}", param="n")
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("prompt_logprobs is not available with stream: true", param="prompt_logprobs")
    try:
        return SamplingParams(
            n=req.n, max_tokens=max_tokens, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0), min_p=pick("min_p", 0.0), seed=req.seed, stop=stop_list(req.stop),
            stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
            presence_penalty=pick("presence_penalty", 0.0), frequency_penalty=pick("frequency_penalty", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            min_tokens=req.min_tokens, skip_special_tokens=req.skip_special_tokens, structured_outputs=structured)
    except ValueError as e:          # SamplingParams names the parameter first: "top_p must be in (0, 1], got 2"
        msg = str(e)
        name = msg.split()[0]
        raise bad_request(msg, param=name if name in type(req).model_fields else None) from None

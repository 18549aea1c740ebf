"""Qwen3.5's XML tool calls: checks of the tool fields of a chat request, and the parser of the model's calls.

The model calls a function as

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

with several blocks for parallel calls and optional prose before the first. As vLLM's qwen3_coder parser, values
are converted by the function's JSON-schema parameter types: a "string" parameter (or one without a type, or of a
function or parameter the tools do not declare) stays text; any other type goes through json.loads and stays text
when that fails. A block that does not parse, or is cut off before `</tool_call>`, stays in the content as text.

`ToolCallStreamer` is the parser fed cumulative text (the server's streaming path); `parse_tool_calls` feeds it the
whole text at once, so both paths give the same calls and content whatever the chunking. `tool_call_grammar` is the
same format as a grammar (structured outputs): `tool_choice` "required" or a named function, and `strict` functions,
are enforced by masking the sampler to it.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


class ToolRequestError(ValueError):
    """A bad tool field in a request; `param` names it ("tools.0.function.name")."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


# -- request checks ------------------------------------------------------------------------------------------------
def check_tools(tools) -> list[dict]:
    """OpenAI function tools: {"type": "function", "function": {"name", "description"?, "parameters"?}}, the
    parameters a JSON-schema object. Returned unchanged (the chat template renders them as given)."""
    if not isinstance(tools, list) or not tools:
        raise ToolRequestError("tools", "must be a non-empty list of function tools")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolRequestError(f"{where}.type", 'only tools of type "function" are supported')
        if set(tool) - {"type", "function"}:
            raise ToolRequestError(f"{where}.{sorted(set(tool) - {'type', 'function'})[0]}", "unknown tool field")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolRequestError(f"{where}.function", "must be an object {name, description, parameters}")
        extra = set(fn) - {"name", "description", "parameters", "strict"}
        if extra:
            raise ToolRequestError(f"{where}.function.{sorted(extra)[0]}", "unknown function field")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ToolRequestError(f"{where}.function.name", "must be 1-64 letters, digits, '_', '-', '.' or ':', "
                                                             f"got {json.dumps(name)}")
        if name in names:
            raise ToolRequestError(f"{where}.function.name", f"duplicate function name {name!r}")
        names.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ToolRequestError(f"{where}.function.description", "must be a string")
        params = fn.get("parameters")
        if params is not None and not (isinstance(params, dict) and params.get("type", "object") == "object"
                                       and isinstance(params.get("properties", {}), dict)):
            raise ToolRequestError(f"{where}.function.parameters",
                                   'must be a JSON-schema object ({"type": "object", "properties": {...}})')
        if fn.get("strict") not in (None, False, True):
            raise ToolRequestError(f"{where}.function.strict", "must be a boolean")
    return tools


def check_tool_choice(tool_choice, tools: list[dict] | None) -> tuple[bool, str | None]:
    """(whether the completion is parsed for calls, the calls it must make): "auto" (the default with tools) parses,
    "none" does not (the tools are still rendered, as vLLM does); "required" must call some function and
    {"type": "function", "function": {"name": N}} must call N (both by constrained decoding: `tool_call_grammar`)."""
    if tool_choice is None:
        return tools is not None, None
    if tool_choice == "none":
        return False, None
    if tool_choice in ("auto", "required") and tools is None:
        raise ToolRequestError("tool_choice", f'"{tool_choice}" needs tools')
    if tool_choice == "auto":
        return True, None
    if tool_choice == "required":
        return True, "required"
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(fn, dict) \
            and set(tool_choice) == {"type", "function"} and set(fn) == {"name"}:
        names = [t["function"]["name"] for t in tools or []]
        if fn["name"] not in names:
            raise ToolRequestError("tool_choice.function.name", f"{json.dumps(fn['name'])[:60]} is not among the "
                                                                f"tools ({', '.join(names) or 'none'})")
        return True, fn["name"]
    raise ToolRequestError("tool_choice", '\'must be "auto", "none", "required" or {"type": "function", "function": '
                                          f'{{"name": ...}}}}, got {json.dumps(tool_choice)[:60]}')


def tool_call_grammar(tools: list[dict], must: str | None, parallel: bool, token) -> str:
    """Lark rules (for structured outputs) of the text this module parses: with `must` ("required" or a function's
    name) a rule `calls` of one call (several, newline-separated, when parallel) to any function or to the named
    one; without, a rule `calls` of optional prose and then optional calls ("auto" with strict functions). Each
    call names its function's parameters in schema order, the required ones always; a "string" parameter (or
    one of string enum values) is raw text, any other is compact JSON valid under its schema. token(text): the Lark
    expression of a tag (a token id where the tokenizer has the tag as one added token)."""
    from qwen35_jax.engine.structured import json_expression, lark_literal
    rules, calls = ["PARAM_TEXT: /(.|\\n)*/ & ~/(.|\\n)*\\n<\\/parameter>(.|\\n)*/"], []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        if must not in (None, "required", fn["name"]):
            continue
        params = fn.get("parameters") or {}
        required = set(params.get("required", []))
        parts = []
        for j, (name, schema) in enumerate(params.get("properties", {}).items()):
            schema = schema if isinstance(schema, dict) else {}
            if schema.get("type") == "string":
                enum = schema.get("enum")
                value = "(" + " | ".join(map(lark_literal, enum)) + ")" if enum and all(
                    isinstance(v, str) for v in enum) else "PARAM_TEXT"
            else:
                value = json_expression(schema)
            opening, closing = lark_literal(f"<parameter={name}>\n"), lark_literal("\n</parameter>\n")
            rules.append(f"f{i}_{j}: {opening} {value} {closing}")
            parts.append(f"f{i}_{j}" + ("" if name in required else "?"))
        head, tail = lark_literal(f"\n<function={fn['name']}>\n"), lark_literal("</function>\n")
        rules.append(f"f{i}: {token(TOOL_CALL_START)} {head} {' '.join(parts)} {tail} {token(TOOL_CALL_END)}")
        calls.append(f"f{i}")
    rules.append("call: " + " | ".join(calls))
    many = 'call ("\\n" call)*' if parallel else "call"
    rules.append(f"calls: {many}" if must is not None else f"calls: /(.|\\n)*/ ({many})?")
    return "\n".join(rules)


def chat_grammar(tokenizer, prompt_ids: list[int], spec, tools: list[dict] | None, must: str | None,
                 parallel: bool):
    """The constraint of a chat completion (a StructuredOutputsParams, or None): `spec` (the request's structured
    output), or the calls that tool_choice "required" / a named function (`must`) or a strict function under
    "auto" demand (`tool_call_grammar`). Where the prompt leaves the model inside a reasoning block (`<think>`
    opened: thinking on), the grammar first lets it reason freely up to `</think>`. ValueError: a Lark grammar
    with thinking on (it cannot be composed so)."""
    from qwen35_jax.engine.sampling_params import StructuredOutputsParams
    from qwen35_jax.engine.structured import lark_grammar, lark_literal
    from qwen35_jax.server.generation import reasoning_opened, think_token_ids
    strict = tools is not None and must is None and spec is None and any(t["function"].get("strict") for t in tools)
    if spec is None and must is None and not strict:
        return None
    think = think_token_ids(tokenizer)
    prefix = f'/(.|\\n)*/ <[{think[1]}]> "\\n\\n"' if reasoning_opened(think, prompt_ids) else ""
    if spec is not None:
        return StructuredOutputsParams(grammar=lark_grammar(spec, prefix)) if prefix else spec
    added = tokenizer.hf.get_added_vocab()
    token = lambda text: f"<[{added[text]}]>" if text in added else lark_literal(text)
    return StructuredOutputsParams(grammar=f"start: {prefix} calls\n{tool_call_grammar(tools, must, parallel, token)}")


def message_tool_fields(m: dict, role: str, where: str) -> dict:
    """The tool fields of one chat message, as the template reads them: an assistant's `tool_calls` (arguments as
    a JSON string or an object, given to the template as an object) and a tool message's `tool_call_id`."""
    out = {}
    if "tool_call_id" in m or role == "tool":
        if role != "tool" or not isinstance(m.get("tool_call_id"), str):
            raise ToolRequestError(f"{where}.tool_call_id", "a tool message needs a string tool_call_id "
                                                            "(and only tool messages have one)")
        out["tool_call_id"] = m["tool_call_id"]
    if m.get("tool_calls") is not None:
        calls = m["tool_calls"]
        if role != "assistant" or not isinstance(calls, list):
            raise ToolRequestError(f"{where}.tool_calls", "only an assistant message has tool_calls, a list")
        out["tool_calls"] = [_history_call(c, f"{where}.tool_calls.{j}") for j, c in enumerate(calls)]
    return out


def _history_call(call, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(fn, dict) \
            or not isinstance(call.get("id"), str) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ToolRequestError(where, 'must be {"id", "type": "function", "function": {"name", "arguments"}}')
    return {"id": call["id"], "type": "function",
            "function": {"name": fn["name"], "arguments": arguments_object(fn.get("arguments"), where)}}


def arguments_object(arguments, where: str) -> dict:
    """A call's arguments as the template needs them: an object (OpenAI sends a JSON string)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise ToolRequestError(f"{where}.function.arguments", "is not valid JSON") from None
    if not isinstance(arguments, dict):
        raise ToolRequestError(f"{where}.function.arguments", "must be a JSON object (or a string of one)")
    return arguments


def history_arguments_as_objects(messages: list[dict]) -> list[dict]:
    """Copies of the messages whose assistant tool-call arguments, when JSON strings, are objects (for LLM.chat)."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("tool_calls"):
            m = {**m, "tool_calls": [
                {**c, "function": {**c["function"], "arguments": arguments_object(
                    c["function"].get("arguments"), f"messages.{i}.tool_calls.{j}")}}
                if isinstance(c, dict) and isinstance(c.get("function"), dict) else c
                for j, c in enumerate(m["tool_calls"])]}
        out.append(m)
    return out


# -- the parser ----------------------------------------------------------------------------------------------------
def parse_tool_calls(text: str, tools: list[dict] | None = None,
                     parallel: bool = True) -> tuple[str | None, list[dict]]:
    """(content, calls) of a completion's text (after the reasoning split). calls are OpenAI tool calls
    {"id", "type": "function", "function": {"name", "arguments": JSON string}}; content is the text around them
    (the prose before the first call), None when calls were found and nothing else; without calls, the text as is.
    tools: the request's tools (their parameter schemas type the values); parallel=False keeps the first call."""
    content, calls = ToolCallStreamer(tools, parallel).feed(text, final=True)
    return (content or None) if calls else content, calls


class ToolCallStreamer:
    """The parser over one sequence's cumulative text: `feed` returns the content text that became final and the
    calls completed since the last feed. Text that may still turn into a call (a partial `<tool_call>` tag, an
    open block, whitespace that would precede a call) is held back until it is decided."""

    def __init__(self, tools: list[dict] | None = None, parallel: bool = True):
        self.schemas = {t["function"]["name"]: (t["function"].get("parameters") or {}).get("properties") or {}
                        for t in tools or () if isinstance(t, dict) and isinstance(t.get("function"), dict)}
        self.parallel = parallel
        self.pos = 0              # characters of the text decided (sent as content, parsed, or dropped)
        self.after_call = False   # the last thing decided was a call: whitespace after it is dropped
        self.gap = ""             # whitespace between content and an open block, kept if the block fails
        self.calls = 0            # calls parsed (including those parallel=False drops)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        content, calls = [], []
        while self.pos < len(text):
            if self.after_call:
                rest = text[self.pos:]
                self.pos += len(rest) - len(rest.lstrip())
                if self.pos == len(text):
                    break
                self.after_call = False
            start = text.find(TOOL_CALL_START, self.pos)
            if start < 0:
                seg = text[self.pos:]
                if final:
                    content.append(seg.rstrip() if self.calls else seg)
                    self.pos = len(text)
                else:
                    sent = seg[:len(seg) - _partial_tag(seg)].rstrip()
                    content.append(sent)
                    self.pos += len(sent)
                break
            seg = text[self.pos:start]
            if seg:
                content.append(seg.rstrip())
                self.gap = seg[len(seg.rstrip()):]
            self.pos = start
            end = text.find(TOOL_CALL_END, start)
            if end < 0:
                if final:                         # cut off (max_tokens): the raw block is content
                    content.append(self.gap + text[start:])
                    self.pos = len(text)
                break
            end += len(TOOL_CALL_END)
            call = self._parse_block(text[start + len(TOOL_CALL_START):end - len(TOOL_CALL_END)])
            if call is None:
                content.append(self.gap + text[start:end])
            else:
                if self.parallel or not self.calls:
                    calls.append(call)
                self.calls += 1
                self.after_call = True
            self.gap, self.pos = "", end
        return "".join(content), calls

    def _parse_block(self, block: str) -> dict | None:
        m = _FUNCTION.fullmatch(block)
        if m is None:
            return None
        name, body = m.group(1).strip(), m.group(2)
        if not name or _PARAMETER.sub("", body).strip():
            return None
        schema = self.schemas.get(name, {})
        args = {}
        for p in _PARAMETER.finditer(body):
            value = p.group(2)
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            args[p.group(1).strip()] = _convert(value, schema.get(p.group(1).strip()))
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _convert(value: str, schema) -> Any:
    """A parameter's text as its schema types it: string (or untyped, or unknown) stays text, others json.loads."""
    types = schema.get("type") if isinstance(schema, dict) else None
    types = types if isinstance(types, list) else [types]
    if None in types or "string" in types:
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _partial_tag(text: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of `<tool_call>` (it may become one)."""
    for n in range(min(len(text), len(TOOL_CALL_START) - 1), 0, -1):
        if text.endswith(TOOL_CALL_START[:n]):
            return n
    return 0

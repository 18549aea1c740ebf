"""The OpenAI-compatible HTTP API over one Engine: /v1/chat/completions, /v1/completions, /v1/models, /health,
/metrics, /start_profile, /stop_profile, /reset_prefix_cache.

`create_app` builds the FastAPI app: it puts the engine, the ServerConfig and what is derived from them once
(tokenizer, think ids, chat-template variables, metrics registry) on `app.state`, includes the module-level routes
and registers the exception handlers. Routes read that state from `request.app.state`.

Request bodies are read and checked here (API key, size limit, JSON, schema in server_protocol, context length)
before anything reaches the engine, so bad input is a 4xx and costs the engine nothing. Responses are built as plain
dicts (cheaper than pydantic per streamed chunk). A client that goes away aborts its engine requests: streaming
through Starlette's disconnect listener (the response task is cancelled), non-streaming through a watcher on the
ASGI receive channel. Large bodies, chat templates and tokenization run on worker threads, off the event loop.
On shutdown `Lifecycle.drain` (called by serve.py) refuses new requests, waits for the running ones, then ends the
rest with an error response instead of cutting the connection.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from qwen35_jax.engine.outputs import CompletionOutput
from qwen35_jax.engine.sampling_params import StructuredOutputsParams
from qwen35_jax.server.generation import Generation, ReasoningSplitter, think_token_ids
from qwen35_jax.server.metrics import register_engine_metrics
from qwen35_jax.server.protocol import (
    MAX_SEQUENCES_PER_REQUEST,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    chat_messages,
    chat_tools,
    check_json,
    constraint,
    parse,
    prompts,
    sampling_params,
)
from qwen35_jax.server.tool_calls import ToolCallStreamer, chat_grammar, parse_tool_calls

log = logging.getLogger(__name__)
DEFAULT_MAX_BODY_BYTES = 8 * 2**20


@dataclasses.dataclass
class ServerConfig:
    served_model_names: list[str]
    model_path: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    generation_defaults: dict = dataclasses.field(default_factory=dict)
    reasoning_parser: bool = True         # split <think>...</think> into reasoning_content
    profile_dir: str | None = None        # where POST /start_profile writes traces


class _ClientGone(Exception):
    pass


def create_app(engine, config: ServerConfig, registry: CollectorRegistry) -> FastAPI:
    """The app serving `engine`. `registry` is the one the engine's PrometheusObserver records into; the engine's
    scrape-time gauges and counters are added to it here, and /metrics exports it."""
    app = FastAPI(title="qwen35_jax", docs_url=None, redoc_url=None, openapi_url=None)
    model_name = config.served_model_names[0]
    register_engine_metrics(registry, engine, model_name)
    tokenizer = engine.tokenizer
    state = app.state
    state.engine, state.config, state.registry, state.model_name = engine, config, registry, model_name
    state.tokenizer = tokenizer
    state.think_ids = think_token_ids(tokenizer) if tokenizer is not None and config.reasoning_parser else None
    state.template_vars = _template_variables(tokenizer)
    state.created_at = int(time.time())
    state.lifecycle = Lifecycle()
    app.include_router(public)
    app.include_router(router)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(_ClientGone, _client_gone)
    app.add_exception_handler(Exception, _internal_error)
    return app


# -- errors --------------------------------------------------------------------------------------------------------
async def _api_error(request: Request, e: APIError):
    return JSONResponse(e.body(), status_code=e.status)


async def _http_error(request: Request, e: StarletteHTTPException):
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return JSONResponse(APIError(e.status_code, str(e.detail), kind).body(), status_code=e.status_code)


async def _client_gone(request: Request, e: _ClientGone):
    return Response(status_code=499)           # nobody reads it: the client closed the connection


async def _internal_error(request: Request, e: Exception):
    log.exception("unhandled error serving %s", request.url.path)
    return JSONResponse(APIError(500, f"internal error: {type(e).__name__}", "internal_error").body(),
                        status_code=500)


# -- request dependencies: API key, then the body (size limit, JSON object) ----------------------------------------
async def require_api_key(request: Request):      # async: FastAPI would run a plain def in a thread
    key = request.app.state.config.api_key
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "missing or invalid API key (send Authorization: Bearer <key>)",
                       "authentication_error", code="invalid_api_key")


async def json_body(request: Request) -> dict:
    limit = request.app.state.config.max_body_bytes
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise APIError(413, f"request body is larger than {limit} bytes", code="request_too_large") \
            if length.isdigit() else bad_request("invalid Content-Length header")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"request body is larger than {limit} bytes", code="request_too_large")
    except ClientDisconnect:
        raise _ClientGone() from None
    # a large body is decoded and checked off the event loop, so other requests and streams do not wait on it
    obj = await asyncio.to_thread(_decode, body) if len(body) > 2**16 else _decode(body)
    if not isinstance(obj, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    return obj


def _decode(body: bytes):
    try:
        obj = json.loads(body)
    except RecursionError:
        raise bad_request("request body is nested too deeply", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None
    check_json(obj)
    return obj


async def refuse_when_draining(request: Request):
    if request.app.state.lifecycle.draining:
        raise APIError(503, "the server is shutting down", "service_unavailable", code="server_shutdown")


JSONBody = Annotated[dict, Depends(json_body)]

# /health and /metrics are open; every other route needs the API key (when the server has one).
public = APIRouter()
router = APIRouter(dependencies=[Depends(require_api_key), Depends(refuse_when_draining)])


# -- checks --------------------------------------------------------------------------------------------------------
def check_model(config: ServerConfig, name: str | None):
    if name is not None and name not in config.served_model_names:
        raise APIError(404, f"the model {name!r} does not exist; this server serves "
                            f"{config.served_model_names}", "not_found_error", "model", "model_not_found")


def check_engine(engine):
    if not engine.healthy:
        raise APIError(503, "the engine is not running", "service_unavailable", code="engine_dead")


def check_length(engine, n_prompt: int, max_tokens: int | None, param: str):
    limit = engine.max_model_len
    if max_tokens is None and n_prompt >= limit or max_tokens is not None and n_prompt + max_tokens > limit:
        asked = f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} in the completion)" \
            if max_tokens is not None else f"{n_prompt} tokens in the prompt, leaving none to generate"
        raise bad_request(f"this model's maximum context length is {limit} tokens, but you requested {asked}; "
                          f"shorten the prompt or max_tokens", param=param, code="context_length_exceeded")


async def compile_constraint(engine, spec: StructuredOutputsParams | None, param: str | None, prompts: int,
                             n: int) -> list | None:
    """Compile a request's grammar off the event loop, once per sequence (`n` for each of `prompts`: Generation's
    `matchers`); None without one. An invalid grammar, or an engine that cannot constrain, is a 400 naming
    `param`."""
    if spec is None:
        return None
    try:
        return await asyncio.to_thread(lambda: [[engine.grammar(spec) for _ in range(n)] for _ in range(prompts)])
    except ValueError as e:
        raise bad_request(str(e), param=param) from None


def chat_constraint(state, ids: list[int], spec: StructuredOutputsParams | None, field: str | None,
                    tools: list[dict] | None, must: str | None, parallel: bool):
    """A chat request's constraint and the field it answers to (tool_calls.chat_grammar; a 400 naming it)."""
    if spec is not None and must is not None:
        raise bad_request(f"tool_choice {must!r} and {field} each fix the output; send one", param="tool_choice")
    try:
        out = chat_grammar(state.tokenizer, ids, spec, tools, must, parallel)
    except ValueError as e:
        raise bad_request(f"{field}: {e}", param=field) from None
    return out, None if out is None else field or ("tool_choice" if must else "tools")


def submit(engine, items, params, prefix, param, matchers=None) -> Generation:
    try:
        return Generation(engine, items, params, prefix, matchers)
    except ValueError as e:          # token ids outside the vocabulary, more KV pages than the pool holds
        raise bad_request(str(e), param=param) from None
    except RuntimeError as e:
        raise APIError(503, f"the engine is not running: {e}", "service_unavailable",
                       code="engine_dead") from None


# -- responses, shared by both APIs --------------------------------------------------------------------------------
async def collect(request: Request, gen: Generation):
    """Wait for every output, aborting the engine requests if the client disconnects first."""
    async def consume():
        async for _ in gen.updates():
            pass

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    consumer, watcher = asyncio.ensure_future(consume()), asyncio.ensure_future(disconnected())
    try:
        with request.app.state.lifecycle.track(gen):
            await asyncio.wait((consumer, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not consumer.done():
            consumer.cancel()
        gen.abort()
    if consumer.cancelled() or not consumer.done():
        raise _ClientGone()
    consumer.result()
    if gen.stopped is not None:
        raise APIError(503, gen.stopped, "service_unavailable", code="server_shutdown")
    for out in gen.seen:
        if any(c.finish_reason == "error" for c in out.outputs):
            raise APIError(500, "the engine failed while generating", "internal_error", code="engine_error")
    return gen.seen


async def complete(request: Request, gen: Generation, head: dict, prompt_lens: list[int],
                   choice: Callable[[int, CompletionOutput], dict]) -> dict:
    """The non-streaming body: `choice(prompt index, sequence)` per finished sequence, then the usage."""
    outs = await collect(request, gen)
    choices = [choice(i, c) for i, out in enumerate(outs) for c in out.outputs]
    return {**head, "choices": choices, "usage": usage(gen, prompt_lens)}


async def stream_events(gen: Generation, head: dict, prompt_lens: list[int], include_usage: bool,
                        return_token_ids: bool, chunk: Callable[[int, CompletionOutput, int], dict | None],
                        opening: list[dict] = ()) -> AsyncIterator[str]:
    """The server-sent events of a streaming request: the `opening` choices, then per engine update one chunk per
    sequence that moved, an error event for one that failed, then the usage chunk (if asked) and [DONE].

    `chunk(prompt index, sequence, tokens already sent)` gives the API's leading choice fields (index, text or
    delta, logprobs), or None when the sequence has nothing new; finish_reason (unless the choice has one),
    stop_reason and token_ids are added here."""
    extra = {"usage": None} if include_usage else {}
    if opening:
        yield "".join(event({**head, "choices": [c]} | extra) for c in opening)
    sent, done = {}, set()      # (prompt index, choice index) -> tokens sent; the finished ones
    async for changed in gen.updates():
        buf = []
        for i, out in changed:
            for c in out.outputs:
                key = (i, c.index)
                if key in done:
                    continue
                if c.finish_reason == "error":
                    buf.append(error_event("the engine failed while generating"))
                    done.add(key)
                    continue
                start = sent.get(key, 0)
                choice = chunk(i, c, start)
                if choice is None:
                    continue
                choice.setdefault("finish_reason", c.finish_reason)     # chat sets "tool_calls" itself
                if c.finish_reason is not None:
                    choice["stop_reason"] = c.stop_reason
                    done.add(key)
                if return_token_ids:
                    choice["token_ids"] = c.token_ids[start:]
                sent[key] = len(c.token_ids)
                buf.append(event({**head, "choices": [choice]} | extra))
        if buf:
            yield "".join(buf)
    if include_usage:
        yield event({**head, "choices": [], "usage": usage(gen, prompt_lens)})
    yield "data: [DONE]\n\n"


def token_text(lp, token_id: int) -> str:
    return lp.decoded_token if lp.decoded_token is not None else f"token_id:{token_id}"


def top_entries(entry: dict, k: int):
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank <= k), key=lambda x: x[1].rank)[:k]


def chat_logprobs(c: CompletionOutput, start: int, k: int) -> dict:
    content = []
    for tok, entry in zip(c.token_ids[start:], c.logprobs[start:]):
        lp = entry[tok]
        text = token_text(lp, tok)
        content.append({"token": text, "logprob": _finite(lp.logprob), "bytes": list(text.encode()),
                        "top_logprobs": [{"token": (s := token_text(e, t)), "logprob": _finite(e.logprob),
                                          "bytes": list(s.encode())} for t, e in top_entries(entry, k)]})
    return {"content": content}


def completion_logprobs(c: CompletionOutput, start: int, k: int, offset: int) -> dict:
    return legacy_logprobs(c.token_ids[start:], c.logprobs[start:], k, offset)


def legacy_logprobs(token_ids: list[int], entries: list, k: int, offset: int, tokenizer=None) -> dict:
    """OpenAI's legacy completions logprobs object; an entry None (the first prompt token, which nothing precedes)
    gives a null logprob and top_logprobs, its text from `tokenizer`."""
    tokens, values, tops, offsets = [], [], [], []
    for tok, entry in zip(token_ids, entries):
        if entry is None:
            text = tokenizer.token_to_text(tok) if tokenizer is not None else f"token_id:{tok}"
            values.append(None)
            tops.append(None)
        else:
            text = token_text(entry[tok], tok)
            values.append(_finite(entry[tok].logprob))
            tops.append({token_text(e, t): _finite(e.logprob)
                         for t, e in [(tok, entry[tok])] + top_entries(entry, k)})
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def join_logprobs(a: dict, b: dict) -> dict:
    return {key: a[key] + b[key] for key in a}


def vllm_prompt_logprobs(plp: list | None) -> list | None:
    """vLLM's `prompt_logprobs` field: null first, then {token id: {logprob, rank, decoded_token}} per token."""
    if plp is None:
        return None
    return [None if e is None else {str(t): {"logprob": _finite(lp.logprob), "rank": lp.rank,
                                             "decoded_token": lp.decoded_token} for t, lp in e.items()}
            for e in plp]


def drop_generated(c: CompletionOutput):
    """max_tokens 0 with echo runs one engine step (the engine always samples a token); the token is dropped here,
    in place, so that usage and token_ids do not count it either."""
    c.text, c.token_ids = "", []
    if c.logprobs is not None:
        c.logprobs = []
    if c.finished:
        c.finish_reason, c.stop_reason = "length", None


def usage(gen: Generation, prompt_lens: list[int]) -> dict:
    done = sum(len(c.token_ids) for out in gen.seen if out is not None for c in out.outputs)
    cached = sum(out.num_cached_tokens for out in gen.seen if out is not None)
    return {"prompt_tokens": sum(prompt_lens), "completion_tokens": done,
            "total_tokens": sum(prompt_lens) + done, "prompt_tokens_details": {"cached_tokens": cached}}


def event(obj) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def error_event(message: str) -> str:
    return event(APIError(500, message, "internal_error", code="engine_error").body())


# -- routes --------------------------------------------------------------------------------------------------------
@public.get("/health")
async def health(request: Request):
    engine = request.app.state.engine
    if not engine.healthy:
        return JSONResponse(APIError(503, f"engine loop is not running: {engine.error!r}", "service_unavailable",
                                     code="engine_dead").body(), status_code=503)
    return {"status": "ok"}


@public.get("/metrics")
async def metrics(request: Request):
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)


@router.post("/start_profile")
async def start_profile(request: Request):
    """Start an XLA profiler trace of whatever the engine runs next (as vLLM's endpoint)."""
    from qwen35_jax.tools import profile
    try:
        out = profile.start_profile(request.app.state.config.profile_dir)
    except profile.ProfilerStateError as e:
        raise APIError(409, str(e), "invalid_request_error", code="profiler_state")
    return {"status": "started", "trace_dir": out}


@router.post("/stop_profile")
async def stop_profile(request: Request):
    """Stop the trace; returns the session directory and device ms per block (embed, gdn, attention, ...)."""
    from qwen35_jax.tools import profile
    try:
        session = await asyncio.to_thread(profile.stop_profile)
    except profile.ProfilerStateError as e:
        raise APIError(409, str(e), "invalid_request_error", code="profiler_state")
    hlo = [exe.as_text() for exe in list(request.app.state.engine.executor.compiled.values())]
    blocks = await asyncio.to_thread(profile.summarize, session, hlo)
    return {"status": "stopped", "session_dir": session, "device_ms_by_block": blocks}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request):
    """Drop every cached prefix (as vLLM's endpoint); 409 if a request was being restored from one."""
    if not await asyncio.to_thread(request.app.state.engine.reset_prefix_cache):
        raise APIError(409, "some cached prefixes were being restored into requests and were kept; try again",
                       "invalid_request_error", code="prefix_cache_busy")
    return {"status": "ok"}


@router.get("/v1/models")
async def models(request: Request):
    state = request.app.state
    return {"object": "list", "data": [model_card(state, name) for name in state.config.served_model_names]}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str):
    state = request.app.state
    check_model(state.config, model_id)
    return model_card(state, model_id)


def model_card(state, name: str) -> dict:
    return {"id": name, "object": "model", "created": state.created_at, "owned_by": "qwen35_jax",
            "root": state.config.model_path, "max_model_len": state.engine.max_model_len}


@router.post("/v1/completions")
async def completions(request: Request, body: JSONBody):
    state = request.app.state
    engine, config, tokenizer = state.engine, state.config, state.tokenizer
    req = parse(CompletionRequest, body)
    check_model(config, req.model)
    check_engine(engine)
    echo_only = req.echo and req.max_tokens == 0     # the prompt alone (and its logprobs), as vLLM does
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens must be >= 1 (0 is allowed only with echo: true)", param="max_tokens")
    if req.echo and tokenizer is None:
        raise bad_request("echo needs a tokenizer (the server runs with --skip-tokenizer-init)", param="echo")
    max_tokens = 1 if echo_only else req.max_tokens
    items = []
    for p in prompts(req.prompt):
        if isinstance(p, str):
            if tokenizer is None:
                raise bad_request("text prompts need a tokenizer (the server runs with --skip-tokenizer-init); "
                                  "send token ids", param="prompt")
            ids = await asyncio.to_thread(tokenizer.encode, p)        # off the loop: a long prompt takes seconds
            if not ids:
                raise bad_request("prompt is empty", param="prompt")
            items.append({"prompt": p, "prompt_token_ids": ids})
        else:
            items.append({"prompt": None, "prompt_token_ids": p})
        check_length(engine, len(items[-1]["prompt_token_ids"]), max_tokens, "prompt")
    if len(items) * req.n > MAX_SEQUENCES_PER_REQUEST:
        raise bad_request(f"{len(items)} prompts × n={req.n} exceeds {MAX_SEQUENCES_PER_REQUEST} sequences",
                          param="n")
    k = req.logprobs
    # echo with logprobs covers the prompt too: prompt logprobs at prompt_logprobs, else logprobs (vLLM's rule)
    plp_k = req.prompt_logprobs if req.prompt_logprobs is not None else k if req.echo else None
    spec, field = constraint(req)
    params = sampling_params(req, max_tokens=max_tokens, logprobs=k, prompt_logprobs=plp_k,
                             defaults=config.generation_defaults, structured=spec)
    matchers = await compile_constraint(engine, spec, field, len(items), params.n)
    gen = submit(engine, items, params, "cmpl", "prompt", matchers)
    prompt_lens = [len(it["prompt_token_ids"]) for it in items]
    echo_texts = [it["prompt"] if it["prompt"] is not None else
                  tokenizer.decode(it["prompt_token_ids"], skip_special_tokens=False) for it in items] \
        if req.echo else None
    head = {"id": gen.id, "object": "text_completion", "created": int(time.time()),
            "model": req.model or state.model_name}

    def prompt_part(i: int) -> dict:
        """The echoed prompt's logprobs object (the first token's logprob is null)."""
        ids = items[i]["prompt_token_ids"]
        return legacy_logprobs(ids, gen.seen[i].prompt_logprobs or [None] * len(ids), k, 0, tokenizer)

    if not req.stream:
        def choice(i: int, c: CompletionOutput) -> dict:
            if echo_only:
                drop_generated(c)
            text, lp = c.text, completion_logprobs(c, 0, k, 0) if k is not None else None
            if req.echo:
                text = echo_texts[i] + c.text
                if k is not None:
                    lp = join_logprobs(prompt_part(i), completion_logprobs(c, 0, k, len(echo_texts[i])))
            out = {"index": i * req.n + c.index, "text": text, "logprobs": lp,
                   "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if req.prompt_logprobs is not None:
                out["prompt_logprobs"] = vllm_prompt_logprobs(gen.seen[i].prompt_logprobs)
            if req.return_token_ids:
                out |= {"prompt_token_ids": items[i]["prompt_token_ids"], "token_ids": c.token_ids}
            return out

        return JSONResponse(await complete(request, gen, head, prompt_lens, choice))

    chars = {}      # (prompt index, choice index) -> text characters sent (after the echoed prompt)

    def chunk(i: int, c: CompletionOutput, start: int) -> dict | None:
        if echo_only:
            drop_generated(c)
        key = (i, c.index)
        echo = req.echo and key not in chars       # the first chunk carries the prompt, once its logprobs are in
        if echo and k is not None and gen.seen[i].prompt_logprobs is None and not c.finished:
            return None
        sent = chars.get(key, 0)
        if not echo and len(c.token_ids) == start and len(c.text) == sent and c.finish_reason is None:
            return None
        chars[key] = len(c.text)
        base = len(echo_texts[i]) if req.echo else 0
        lp = completion_logprobs(c, start, k, base + sent) if k is not None else None
        if echo and k is not None:
            lp = join_logprobs(prompt_part(i), lp)
        return {"index": i * req.n + c.index, "text": (echo_texts[i] if echo else "") + c.text[sent:],
                "logprobs": lp}

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return _EventStream(stream_events(gen, head, prompt_lens, include_usage, req.return_token_ids, chunk), gen)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, body: JSONBody):
    state = request.app.state
    engine, config, tokenizer, template_vars = state.engine, state.config, state.tokenizer, state.template_vars
    req = parse(ChatCompletionRequest, body)
    check_model(config, req.model)
    check_engine(engine)
    if tokenizer is None:
        raise bad_request("chat needs a tokenizer (the server runs with --skip-tokenizer-init)")
    messages = chat_messages(req.messages)
    tools, parse_calls, parallel, must = chat_tools(req)
    spec, field = constraint(req)
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs requires logprobs: true", param="top_logprobs")
        if not 0 <= req.top_logprobs <= 20:
            raise bad_request(f"top_logprobs must be in [0, 20], got {req.top_logprobs}", param="top_logprobs")
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise bad_request("max_tokens and max_completion_tokens disagree; send one", param="max_tokens")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    template_kwargs = req.chat_template_kwargs or {}
    for key in template_kwargs:
        if key in RESERVED_TEMPLATE_KWARGS or (template_vars is not None and key not in template_vars):
            raise bad_request(f"chat_template_kwargs.{key}: not a variable this model's chat template reads"
                              + (f" (it reads {sorted(template_vars - RESERVED_TEMPLATE_KWARGS)})"
                                 if template_vars is not None else ""), param=f"chat_template_kwargs.{key}")
    try:
        text = await asyncio.to_thread(tokenizer.apply_chat_template, messages,
                                       **({"tools": tools} if tools else {}), **template_kwargs)
    except Exception as e:      # jinja errors (raise_exception in a template), clashing keyword arguments
        raise bad_request(f"the chat template failed on these messages: {e}", param="messages") from None
    ids = await asyncio.to_thread(tokenizer.encode, text)
    check_length(engine, len(ids), max_tokens, "messages")
    spec, field = chat_constraint(state, ids, spec, field, tools, must, parallel)
    params = sampling_params(req, max_tokens=max_tokens,
                             logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                             defaults=config.generation_defaults, prompt_logprobs=req.prompt_logprobs,
                             structured=spec)
    matchers = await compile_constraint(engine, spec, field, 1, params.n)
    gen = submit(engine, [{"prompt": text, "prompt_token_ids": ids}], params, "chatcmpl", "messages", matchers)
    head = {"id": gen.id, "object": "chat.completion", "created": int(time.time()),
            "model": req.model or state.model_name}
    k = req.top_logprobs or 0
    splitters = [ReasoningSplitter(tokenizer, state.think_ids, ids, params.skip_special_tokens)
                 for _ in range(req.n)]

    if not req.stream:
        def choice(i: int, c: CompletionOutput) -> dict:
            reasoning, content = splitters[c.index].split(c.text, c.token_ids)
            message = {"role": "assistant", "content": content, "reasoning_content": reasoning}
            calls = []
            if parse_calls:
                message["content"], calls = parse_tool_calls(content, tools, parallel)
                if calls:
                    message["tool_calls"] = calls
            out = {"index": c.index, "message": message,
                   "logprobs": chat_logprobs(c, 0, k) if req.logprobs else None,
                   "finish_reason": "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason,
                   "stop_reason": c.stop_reason}
            if req.return_token_ids:
                out["token_ids"] = c.token_ids
            return out

        body = await complete(request, gen, head, [len(ids)], choice)
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = vllm_prompt_logprobs(gen.seen[0].prompt_logprobs)
        if req.return_token_ids:
            body["prompt_token_ids"] = ids
        return JSONResponse(body)

    head["object"] = "chat.completion.chunk"
    chars = [[0, 0] for _ in range(req.n)]      # reasoning, content characters sent
    streamers = [ToolCallStreamer(tools, parallel) if parse_calls else None for _ in range(req.n)]
    n_calls = [0] * req.n

    def chunk(i: int, c: CompletionOutput, start: int) -> dict | None:
        st = chars[c.index]
        reasoning, content = splitters[c.index].split(c.text, c.token_ids)
        delta = {}
        if reasoning is not None and len(reasoning) > st[0]:
            delta["reasoning_content"] = reasoning[st[0]:]
            st[0] = len(reasoning)
        if streamers[c.index] is not None:       # content is what the tool-call parser has decided is content
            new, calls = streamers[c.index].feed(content, final=c.finish_reason is not None)
            if new:
                delta["content"] = new
            if calls:
                delta["tool_calls"] = [{"index": n_calls[c.index] + j, **call} for j, call in enumerate(calls)]
                n_calls[c.index] += len(calls)
        elif len(content) > st[1]:
            delta["content"] = content[st[1]:]
            st[1] = len(content)
        if not delta and len(c.token_ids) == start and c.finish_reason is None:
            return None
        out = {"index": c.index, "delta": delta or {"content": ""},
               "logprobs": chat_logprobs(c, start, k) if req.logprobs else None}
        if n_calls[c.index] and c.finish_reason == "stop":
            out["finish_reason"] = "tool_calls"
        return out

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
               for i in range(req.n)]
    return _EventStream(stream_events(gen, head, [len(ids)], include_usage, req.return_token_ids, chunk, opening),
                        gen)


# Arguments apply_chat_template sets itself; a request may not pass them through chat_template_kwargs.
RESERVED_TEMPLATE_KWARGS = {"messages", "conversation", "add_generation_prompt", "continue_final_message", "tokenize",
                            "tools", "documents", "chat_template", "return_dict", "return_assistant_tokens_mask",
                            "padding", "truncation", "max_length", "return_tensors", "tokenizer_kwargs"}


def _template_variables(tokenizer) -> set[str] | None:
    """The variables the chat template reads, so an unknown chat_template_kwargs key (a typo of enable_thinking)
    is refused instead of silently rendering the default."""
    template = getattr(tokenizer.hf, "chat_template", None) if tokenizer is not None else None
    if not isinstance(template, str):
        return None
    import jinja2
    import jinja2.meta
    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        log.warning("could not parse the chat template; chat_template_kwargs keys are not checked")
        return None
    return set(jinja2.meta.find_undeclared_variables(ast))


def _finite(x: float) -> float:
    """JSON has no -inf (a token the filters removed): report it as vLLM does."""
    return x if math.isfinite(x) else -9999.0


class _EventStream(StreamingResponse):
    """Server-sent events whose engine requests are aborted however the response ends (finished, client gone,
    server stopping)."""

    media_type = "text/event-stream"

    def __init__(self, content, generation: Generation):
        super().__init__(_guarded(content, generation),
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.generation = generation

    async def __call__(self, scope, receive, send):
        try:
            with scope["app"].state.lifecycle.track(self.generation):
                await super().__call__(scope, receive, send)
        finally:
            self.generation.abort()


DONE = "data: [DONE]\n\n"


async def _guarded(events: AsyncIterator[str], gen: Generation) -> AsyncIterator[str]:
    """`events`, with an error event before [DONE] when the server stopped the generation early, and an error
    event and [DONE] instead of a cut connection when building the events fails."""
    try:
        async for chunk in events:
            if chunk == DONE and gen.stopped is not None:
                yield event(APIError(503, gen.stopped, "service_unavailable", code="server_shutdown").body())
            yield chunk
    except Exception:
        log.exception("stream failed")
        yield error_event("internal error while streaming") + DONE


class Lifecycle:
    """Graceful shutdown: refuse new requests, give the running ones time to finish, then end the rest with an
    error response (JSON, or an error event and [DONE]) instead of cutting their connections."""

    def __init__(self):
        self.draining = False
        self.ended: str | None = None         # set once the remaining generations were ended
        self.live: set[Generation] = set()    # generations a response is waiting on

    @contextlib.contextmanager
    def track(self, gen: Generation):
        self.live.add(gen)
        if self.ended is not None:
            gen.stop(self.ended)
        try:
            yield
        finally:
            self.live.discard(gen)

    async def drain(self, timeout: float, busy: Callable[[], bool] | None = None):
        """Refuse new requests; wait up to `timeout` seconds while `busy()` (default: a response is waiting on a
        generation); then stop every generation still running, so its response ends with an error."""
        self.draining = True
        busy = busy or (lambda: bool(self.live))
        deadline = time.monotonic() + timeout
        while busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.live:
            log.warning("shutdown timeout (%.0fs) reached: ending %d running request(s) with an error", timeout,
                        len(self.live))
        self.ended = "the server is shutting down"
        for gen in list(self.live):
            gen.stop(self.ended)

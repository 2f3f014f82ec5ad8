"""The OpenAI-compatible HTTP API (FastAPI): models, completions and chat completions, streamed as
server-sent events or returned whole; health and Prometheus metrics. Every error is an OpenAI-style
body with the right status; the engine thread does the generation."""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections.abc import Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from meshtrain.data.tokenizer import token_bytes
from meshtrain.serve.chat import ToolUse, chat_prompt, tool_use
from meshtrain.serve.engine import Engine, SamplingParams
from meshtrain.serve.engine import Request as Generation
from meshtrain.serve.grammar import Constraint, grammar_tokenizer, response_format_grammar
from meshtrain.serve.loading import ServedModel, default_completion_length, truncations_given
from meshtrain.serve.requests import APIError, ChatRequest, CompletionRequest, Sampling
from meshtrain.serve.tools import CallStream


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# How often a non-streaming request looks whether its client is still there while it waits for tokens
DISCONNECT_POLL_S = 0.25


def _metrics(app: FastAPI, engine: Engine) -> CollectorRegistry:
    """Prometheus metrics of this app: requests by path and status, tokens, queue, time to first token."""
    registry = CollectorRegistry()
    requests_total = Counter(
        "meshtrain_requests", "HTTP requests by path and status", ["path", "status"], registry=registry
    )
    tokens = Counter("meshtrain_generated_tokens", "tokens generated", registry=registry)
    prefilled = Counter(
        "meshtrain_prefilled_tokens", "prompt tokens computed (once for the n answers of a prompt)", registry=registry
    )
    Gauge(
        "meshtrain_queue_length", "requests waiting for room in the batch or the KV cache", registry=registry
    ).set_function(engine.queued)
    Gauge("meshtrain_running_requests", "requests in the running batch", registry=registry).set_function(
        lambda: len(engine.running)
    )
    Gauge(
        "meshtrain_kv_cache_usage", "fraction of the KV cache's blocks held by requests", registry=registry
    ).set_function(lambda: engine.cache.used() / engine.cache.blocks)
    Gauge(
        "meshtrain_prefix_cache_hit_tokens", "prompt tokens read from the prefix cache since start", registry=registry
    ).set_function(lambda: engine.cached_tokens)
    Gauge("meshtrain_preemptions", "requests preempted for KV-cache room since start", registry=registry).set_function(
        lambda: engine.preemptions
    )
    ttft = Histogram(
        "meshtrain_time_to_first_token_seconds",
        "time from arrival to first token",
        registry=registry,
        buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    )
    engine.on_first_token, engine.on_tokens, engine.on_prefill = ttft.observe, tokens.inc, prefilled.inc

    app.add_middleware(_CountRequests, counter=requests_total)
    return registry


class _CountRequests:
    """Counts each HTTP request by path and status, as plain ASGI: Starlette's BaseHTTPMiddleware
    would wrap `receive` so that a route never sees its client hang up (Request.is_disconnected).
    An exception no handler caught counts as a 500 (ServerErrorMiddleware answers it, OpenAI's body)."""

    def __init__(self, app, counter: Counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def sent(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            path = scope["path"]
            self.counter.labels(path if path.startswith("/v1/") else "other", str(status)).inc()


def _error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        kind = {401: "authentication_error", 404: "not_found_error"}.get(e.status, "invalid_request_error")
        kind = "server_error" if e.status >= 500 else kind
        return JSONResponse(error_body(e.message, kind, e.param, e.code), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, e: RequestValidationError):
        errors = e.errors()
        if any(err.get("type") == "json_invalid" for err in errors):
            return JSONResponse(error_body("the request body is not valid JSON", "invalid_request_error"), 400)
        first = errors[0]
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        if first.get("type") == "extra_forbidden":
            message = f"{param}: this server does not support this parameter; leave it out"
            return JSONResponse(error_body(message, "invalid_request_error", param, "unsupported_parameter"), 400)
        return JSONResponse(error_body(f"{param or 'body'}: {first.get('msg')}", "invalid_request_error", param), 422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return JSONResponse(error_body(str(e.detail), "invalid_request_error"), e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        return JSONResponse(error_body(f"internal error: {e}", "server_error"), 500)


def create_app(served: ServedModel, engine: Engine, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="meshtrain", docs_url=None, redoc_url=None)
    registry = _metrics(app, engine)
    _error_handlers(app)
    try:  # what structured output and tool calls decode over; plain serving does without it
        grammar_vocab, unreadable = (
            grammar_tokenizer(served.tokenizer, served.model.args.vocab_size, served.eos_ids),
            "",
        )
    except Exception as e:
        grammar_vocab, unreadable = None, f"this model's tokenizer cannot be read by llguidance ({e})"

    async def authorize(request: Request) -> None:
        if api_key and request.headers.get("authorization", "") != f"Bearer {api_key}":
            raise APIError(401, "missing or wrong API key: send Authorization: Bearer <key>", code="invalid_api_key")

    @app.get("/health")
    async def health():
        if engine.failure is not None:
            return JSONResponse({"status": "failed", "model": served.name, "error": engine.failure}, 503)
        return {"status": "ok", "model": served.name}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models():
        return {
            "object": "list",
            "data": [{"id": served.name, "object": "model", "created": 0, "owned_by": "meshtrain"}],
        }

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionRequest, request: Request):
        prompt = body.prompt if isinstance(body.prompt, str) else _single(body.prompt)
        if not isinstance(prompt, str):  # token ids
            prompt = _token_ids(served, prompt)
        if body.suffix:
            raise APIError(400, "suffix: inserting text is not supported (a decoder-only model)", "suffix")
        return await _generate(served, engine, body, prompt, request, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(body: ChatRequest, request: Request):
        if body.max_completion_tokens is not None:
            if body.max_tokens not in (None, body.max_completion_tokens):
                raise APIError(
                    400,
                    f"max_tokens ({body.max_tokens}) and max_completion_tokens ({body.max_completion_tokens}) "
                    "differ: send only max_completion_tokens",
                    "max_completion_tokens",
                )
            body.max_tokens = body.max_completion_tokens
        if grammar_vocab is None and (body.response_format not in (None, {"type": "text"}) or body.tools):
            raise APIError(
                400, f"response_format and tools: {unreadable}", "tools" if body.tools else "response_format"
            )
        grammar = response_format_grammar(body.response_format, grammar_vocab)
        tools = tool_use(served, body, grammar_vocab)
        if tools is not None and grammar is not None:
            raise APIError(
                400, "response_format with tools: send one (tool_choice none leaves the tools out)", "response_format"
            )
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        grammar = tools.grammar if tools is not None and tools.grammar else grammar
        vocab = served.model.args.vocab_size
        constrain = None if grammar is None else functools.partial(Constraint, grammar_vocab, grammar, vocab)
        prompt = chat_prompt(served, body.messages, tools.schemas if tools else None)
        return await _generate(served, engine, body, prompt, request, chat=True, constrain=constrain, tools=tools)

    return app


def _token_ids(served: ServedModel, ids: list[int]) -> list[int]:
    vocab = served.model.args.vocab_size
    if any(not 0 <= i < vocab for i in ids):
        raise APIError(400, f"prompt: token ids must be between 0 and {vocab - 1}", "prompt")
    return ids


def _single(prompts: list) -> str | list[int]:
    """One prompt: a string, a list of one string, token ids, or a list of one list of token ids."""
    if prompts and all(isinstance(p, int) for p in prompts):
        return prompts
    if len(prompts) != 1:
        raise APIError(400, "prompt: send one prompt per request (a list of one string is accepted)", "prompt")
    return prompts[0]


def _check(served: ServedModel, engine: Engine, body: Sampling, prompt_ids: list[int], chat: bool) -> SamplingParams:
    if body.model != served.name:
        raise APIError(
            404, f"model {body.model!r} does not exist: this server serves {served.name!r}", "model", "model_not_found"
        )
    best_of = getattr(body, "best_of", None)
    for key, count in (("n", body.n), ("best_of", best_of or 1)):
        if count > engine.max_batch:
            raise APIError(
                400,
                f"{key}: at most {engine.max_batch} answers a request (the server's --max-batch), got {count}",
                key,
            )
    if best_of is not None and best_of < body.n:
        raise APIError(400, f"best_of ({best_of}) must be at least n ({body.n})", "best_of")
    if best_of is not None and best_of > body.n and body.stream:
        raise APIError(400, "best_of: more answers than n are ranked with stream: false only", "best_of")
    if body.logit_bias:
        raise APIError(400, "logit_bias: not supported by this server; leave it out", "logit_bias")
    if body.stream_options is not None and not body.stream:
        raise APIError(
            400, "stream_options is only allowed when stream is true: leave it out or set stream", "stream_options"
        )
    if not prompt_ids:
        raise APIError(400, "the prompt is empty", "prompt")
    echo = getattr(body, "echo", False)
    logprobs = (body.top_logprobs or 0) if chat and body.logprobs else None if chat else body.logprobs
    if body.stream and (echo or logprobs is not None):
        raise APIError(400, "logprobs and echo are returned with stream: false only", "stream")
    room = engine.max_context - len(prompt_ids)
    openai_default = room if chat else 16  # OpenAI: chat to the end of the context, completions 16
    default = default_completion_length(served.sampling_defaults, len(prompt_ids), room, openai_default)
    max_tokens = body.max_tokens if body.max_tokens is not None else default  # the request's own: not capped
    if max_tokens == 0 and not echo:
        raise APIError(400, "max_tokens: 0 only with echo (scoring the prompt)", "max_tokens")
    if room < 0 or (room < 1 and max_tokens) or max_tokens > room:
        raise APIError(
            400,
            f"this model's maximum context length is {engine.max_context} tokens; the prompt has "
            f"{len(prompt_ids)} and max_tokens asks for {max_tokens}: shorten the prompt or lower "
            "max_tokens",
            "max_tokens",
            "context_length_exceeded",
        )
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > 4 or any(not s for s in stop):
        raise APIError(400, "stop: up to 4 non-empty strings", "stop")
    stop, stop_ids = _special_stops(served, stop)
    if best_of is not None and best_of > body.n and body.temperature == 0:
        raise APIError(
            400,
            "best_of picks among sampled answers, but temperature 0 decodes greedily (every answer the same): "
            "drop it, or sample (temperature > 0)",
            "best_of",
        )
    if body.temperature == 0 and (idle := truncations_given(body.top_p, body.top_k)):
        raise APIError(
            400,
            f"{idle[0]} shapes sampling, but temperature 0 decodes greedily: drop it, or sample (temperature > 0)",
            idle[0],
        )
    greedy_default = body.temperature is None and served.sampling_defaults.get("temperature") == 0
    seeded = ["seed"] if body.seed is not None else []  # a seed draws nothing where decoding is greedy
    if greedy_default and (shaping := truncations_given(body.top_p, body.top_k) + seeded):
        raise APIError(
            400,
            f"{shaping[0]} shapes sampling, but this model decodes greedily unless a request gives a temperature "
            "(its generation_config.json): send a temperature above 0 with it",
            shaping[0],
        )
    return SamplingParams(
        max_tokens,
        _or_default(body.temperature, served, "temperature", 1.0),
        _or_default(body.top_p, served, "top_p", 1.0),
        max(0, _or_default(body.top_k, served, "top_k", 0)),
        stop,
        body.seed,
        body.presence_penalty,
        body.frequency_penalty,
        logprobs,
        echo,
        stop_ids,
        score=best_of is not None and best_of > body.n,
    )


def _or_default(value, served: ServedModel, key: str, openai_default: float):
    """A request's sampling value; left out, the model's (generation_config.json), else OpenAI's."""
    return value if value is not None else served.sampling_defaults.get(key, openai_default)


def _special_stops(served: ServedModel, stop: list[str]) -> tuple[list[str], frozenset[int]]:
    """Stop strings that are special tokens (`<|im_end|>`) stop at that token: the decoded text
    leaves special tokens out, so as text they would never match. One inside a longer string could
    never match either: refused."""
    special = served.special_tokens
    ids = frozenset(special[s] for s in stop if s in special)
    for s in stop:
        inside = next((token for token in special if token in s and token != s), None)
        if inside is not None:
            raise APIError(
                400,
                f"stop: {s!r} holds the special token {inside!r}, which never appears in the generated text: "
                f"give {inside!r} as a stop of its own",
                "stop",
            )
    return [s for s in stop if s not in special], ids


def _encode(served: ServedModel, text: str, chat: bool) -> list[int]:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"the text is not valid Unicode ({e.reason} at {e.start}): send UTF-8 text") from None
    return served.prompt_ids(text, chat)


def _token_text(served: ServedModel, token: int) -> str:
    return served.tokenizer.decode([token])


def _completion_logprobs(served: ServedModel, generation: Generation, prompt_text: str, echo: bool) -> dict:
    """OpenAI's legacy completions format: tokens, token_logprobs, top_logprobs, text_offset."""
    entries = (generation.prompt_logprobs if echo else []) + generation.logprobs
    tokens = [_token_text(served, e.token) for e in entries]
    offsets, at = [], 0 if echo else len(prompt_text)  # offsets into the prompt + the answer
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [None if e.logprob is None else _top_by_text(served, e.top) for e in entries],
        "text_offset": offsets,
    }


def _top_by_text(served: ServedModel, top: dict[int, float]) -> dict[str, float]:
    """The legacy format's {token text: logprob}: where two tokens read alike (pieces of one UTF-8
    character both read U+FFFD) the likelier one's (`top` runs from the likeliest) is kept."""
    by_text = {}
    for token, logprob in top.items():
        by_text.setdefault(_token_text(served, token), logprob)
    return by_text


def _chat_logprobs(served: ServedModel, generation: Generation) -> dict:
    def entry(token: int, logprob: float) -> dict:
        raw = token_bytes(served.tokenizer, token)  # a piece of a character: its own byte, not U+FFFD's
        return {"token": _token_text(served, token), "logprob": logprob, "bytes": list(raw)}

    return {
        "content": [
            {**entry(e.token, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top.items()]}
            for e in generation.logprobs
        ]
    }


async def _generate(
    served: ServedModel,
    engine: Engine,
    body: Sampling,
    prompt: str | list[int],
    request: Request,
    chat: bool,
    constrain: Callable[[], Constraint] | None = None,
    tools: ToolUse | None = None,
):
    """The request's answers (n, or best_of ranked to n) generated as one group, one prefill;
    `constrain`: each answer's own grammar state, where response_format or tool_choice asks for
    one; `tools`: answers read for tool calls."""
    prompt_ids = _encode(served, prompt, chat) if isinstance(prompt, str) else prompt
    prompt = prompt if isinstance(prompt, str) else served.tokenizer.decode(prompt)
    params = _check(served, engine, body, prompt_ids, chat)
    loop, events = asyncio.get_running_loop(), asyncio.Queue()

    def emit_to(index: int):
        return lambda event: loop.call_soon_threadsafe(events.put_nowait, (index, *event))

    count = getattr(body, "best_of", None) or body.n
    generations = [
        Generation(prompt_ids, params, emit_to(i), constraint=constrain() if constrain else None) for i in range(count)
    ]
    engine.submit_group(generations)
    meta = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": served.name,
    }
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(
            _stream(generations, events, meta, chat, include_usage, tools), media_type="text/event-stream"
        )
    texts, finishes, looked = [[] for _ in generations], [None] * count, time.monotonic()
    try:
        while None in finishes:
            # a client that hung up (a timeout) stops its generation, as a stream's does
            if time.monotonic() - looked > DISCONNECT_POLL_S:
                if await request.is_disconnected():
                    return Response(status_code=499)  # nobody reads it: nginx's "client closed request"
                looked = time.monotonic()
            try:
                index, kind, value = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                continue
            if kind == "text":
                texts[index].append(value)
            elif kind == "error":
                raise APIError(500, value)
            else:
                finishes[index] = value
    finally:
        for generation in generations:  # a finished one is gone already; one whose client went away frees its slot
            generation.cancel()
    usage = _usage(generations)
    kept = range(count)
    if count > body.n:  # best_of: the n likeliest answers, by their mean log-probability per token
        kept = sorted(kept, key=lambda i: -generations[i].score / max(1, len(generations[i].generated)))[: body.n]
    choices = []
    for index, i in enumerate(kept):
        text, generation = "".join(texts[i]), generations[i]
        if chat:
            message, finish = {"role": "assistant", "content": text}, finishes[i]
            parsed = tools.read(text) if tools is not None else None
            if parsed is not None and parsed.calls:
                message = {"role": "assistant", "content": parsed.content, "tool_calls": parsed.calls}
                finish = tools.finish_reason(finish, parsed.calls)
            logprobs = _chat_logprobs(served, generation) if params.logprobs is not None else None
            choices.append({"index": index, "message": message, "finish_reason": finish, "logprobs": logprobs})
            continue
        answer = (prompt if params.echo else "") + text
        scored = params.logprobs is not None  # echo alone returns the prompt's text, not its scores (OpenAI)
        logprobs = _completion_logprobs(served, generation, prompt, params.echo) if scored else None
        choices.append({"index": index, "text": answer, "finish_reason": finishes[i], "logprobs": logprobs})
    kind = "chat.completion" if chat else "text_completion"
    return {**meta, "object": kind, "usage": usage, "choices": choices}


def _usage(generations: list[Generation]) -> dict:
    """The prompt once, every generated token (best_of's answers not returned too, as OpenAI bills them)."""
    prompt, completion = len(generations[0].prompt), sum(len(g.generated) for g in generations)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _stream(
    generations: list[Generation],
    events: asyncio.Queue,
    meta: dict,
    chat: bool,
    include_usage: bool,
    tools: ToolUse | None = None,
):
    """Each answer's deltas under its choice index, as they come; [DONE] once every answer ended.
    With tools, what may be a tool call is held back to the answer's end, then sent as tool_calls."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    calls = [CallStream(tools.fmt, tools.read) for _ in generations] if tools is not None else None

    def chunk(
        index: int, delta: str | None, finish: str | None = None, first: bool = False, tool_calls: list | None = None
    ) -> str:
        if chat:
            content = {"role": "assistant", "content": ""} if first else ({} if delta is None else {"content": delta})
            if tool_calls:
                content = {"tool_calls": [{"index": k, **call} for k, call in enumerate(tool_calls)]}
            choice = {"index": index, "delta": content, "finish_reason": finish}
        else:
            choice = {"index": index, "text": delta or "", "finish_reason": finish, "logprobs": None}
        return f"data: {json.dumps({**meta, 'object': obj, 'choices': [choice]})}\n\n"

    try:
        if chat:
            for index in range(len(generations)):
                yield chunk(index, None, first=True)
        running = len(generations)
        while running:
            index, kind, value = await events.get()
            if kind == "text":
                text = calls[index].feed(value) if calls else value
                if text:
                    yield chunk(index, text)
            elif kind == "error":
                yield f"data: {json.dumps(error_body(value, 'server_error'))}\n\n"
                break
            else:
                held, made = calls[index].finish() if calls else ("", [])
                if held:
                    yield chunk(index, held)
                if made:
                    yield chunk(index, None, tool_calls=made)
                yield chunk(index, None, finish=tools.finish_reason(value, made) if made else value)
                running -= 1
        else:
            if include_usage:
                yield f"data: {json.dumps({**meta, 'object': obj, 'choices': [], 'usage': _usage(generations)})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for generation in generations:  # also when the client disconnected mid-stream
            generation.cancel()

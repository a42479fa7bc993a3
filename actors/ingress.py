"""The OpenAI-compatible HTTP surface (FastAPI through ``serve.ingress``) of the worker replica.

    GET  /health                 200 while the engine runs, 503 once it failed
    GET  /v1/models              the served model
    POST /v1/completions         prompt(s) -> text; SSE with "stream": true
    POST /v1/chat/completions    messages -> the model's chat template -> text
    GET  /metrics                Prometheus text (every replica, see ``metrics``)

``OpenAIRoutes`` is a mixin: the routes run on the worker replica (``worker.LLMServer``), next
to the engine, so a request's tokens take one hop. Errors use OpenAI's envelope:
400 bad parameters or a prompt too long, 401 missing/wrong API key, 404 unknown model,
429 too many requests waiting, 503 engine failed. A client that disconnects cancels the handler,
which closes the request's streams, which aborts the engine requests (freeing blocks and rows).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
import weakref

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mtpserve.actors.engine_loop import EngineFailed, Overloaded
from mtpserve.actors.protocol import (
    SSE_DONE,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SSEChunks,
    TokenizeRequest,
    chat_logprobs,
    chunk_choice,
    completion_body,
    completion_logprobs,
    echo_logprobs,
    joined_logprobs,
    messages_as_dicts,
    parse_tool_calls,
    split_at_tool_call,
    tool_call_deltas,
    usage,
)
from mtpserve.actors.proxy_middleware import VIA_PROXY_HEADER
from mtpserve.actors.sessions import MAX_SESSION_ID_LENGTH
from mtpserve.engine.admission import check_token_ids

REPLICA_HEADER = "x-mtpserve-replica"
SESSION_HEADER = "x-session-id"

api = FastAPI(title="mtpserve", description="OpenAI-compatible serving of hybrid GDN/attention models "
                                             "with MTP speculative decoding")


_replica: list = []          # the replica serving this process's routes (set by the Worker)


def guard(worker) -> None:
    """Make ``worker`` the replica whose API key and body limit ``_refuse_early`` enforces, and
    whose model the OpenAPI schema names."""
    _replica[:] = [worker]
    _schema.clear()


ERROR_ANSWERS = {       # what each route may answer besides 200 (all in the error envelope)
    400: "bad JSON, types or values (error.param names the field), or a prompt too long",
    401: "missing or wrong API key", 404: "unknown model", 411: "a body without a Content-Length",
    413: "a body over the size limit", 429: "too many requests waiting on the replica: retry",
    503: "the engine failed or the replica is stopping"}
ROUTE_ERRORS = {"/v1/completions": (400, 401, 404, 411, 413, 429, 503),
                "/v1/chat/completions": (400, 401, 404, 411, 413, 429, 503),
                "/tokenize": (400, 401, 404, 411, 413), "/detokenize": (400, 401, 404, 411, 413),
                "/v1/models": (401,), "/v1/models/{model_id}": (401, 404), "/health": (503,)}


_schema: list = []           # the schema /openapi.json serves, built on first use


def _openapi() -> dict:
    """FastAPI's /openapi.json source (an instance attribute, so Serve's copy of ``api`` keeps it)."""
    if not _schema:
        _schema.append(openapi_schema(_replica[0].model_name if _replica else "mtpserve"))
    return _schema[0]


def openapi_schema(model_name: str) -> dict:
    """FastAPI's schema with what the server really does: errors are 4xx/5xx envelopes (no 422:
    validation errors are 400s) and `model` is the served model's name."""
    from fastapi.openapi.utils import get_openapi
    schema = get_openapi(title=api.title, version="1", description=api.description, routes=api.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    components["ErrorResponse"] = {
        "type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
    ref = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            for status in ROUTE_ERRORS.get(path, ()):
                responses[str(status)] = {"description": ERROR_ANSWERS[status], "content": ref}
    for name in ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest", "DetokenizeRequest"):
        if name in components:       # `model`: the served name, or left out
            components[name]["properties"]["model"] = {"type": "string", "enum": [model_name],
                                                       "description": "The served model's name; may be left out."}
    return schema


api.openapi = _openapi


class _RefuseEarly:
    """Pure ASGI middleware (streams and client disconnects pass through untouched): before
    FastAPI reads and parses a POST body, the API key (401) and the body's declared size (413;
    411 without a Content-Length), so an unauthenticated or oversized request costs a header
    check, not a parse."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        worker = _replica[0] if _replica else None
        if worker is not None and scope["type"] == "http" and scope["method"] == "POST":
            err = _early_error(worker, {k.decode("latin-1").lower(): v.decode("latin-1")
                                        for k, v in scope.get("headers", ())})
            if err is not None:
                await _answer(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _auth_error(api_key: str | None, authorization: str | None) -> APIError | None:
    """The 401 for a request without the server's key (none when the server has no key)."""
    if api_key and not api_key_matches(authorization, api_key):
        return APIError(401, "invalid or missing API key (Authorization: Bearer <key>)",
                        "authentication_error", None, "invalid_api_key")
    return None


def _early_error(worker, headers: dict[str, str]) -> APIError | None:
    err = _auth_error(worker.api_key, headers.get("authorization"))
    if err is not None:
        return err
    limit, length = worker.config.max_request_bytes, headers.get("content-length")
    if length is None or not length.isdigit():
        return APIError(411, "a request body needs a Content-Length", code="length_required")
    if int(length) > limit:
        return APIError(413, f"the request body is {int(length)} bytes, more than this server's "
                             f"limit of {limit}", code="request_too_large")
    return None


api.add_middleware(_RefuseEarly)


class _CORS:
    """Opt-in CORS (``allowed_origins``): Starlette's CORSMiddleware around everything (preflights
    are answered before the API key is asked for) once the replica's setting is known; without
    one, requests pass untouched."""

    def __init__(self, app):
        self.app, self._cors, self._origins = app, None, None

    async def __call__(self, scope, receive, send):
        origins = _replica[0].config.allowed_origins if _replica else None
        if not origins or scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self._origins != origins:
            from starlette.middleware.cors import CORSMiddleware
            allowed = [o.strip() for o in origins.split(",") if o.strip()]
            self._cors = CORSMiddleware(self.app, allow_origins=allowed, allow_methods=["GET", "POST"],
                                        allow_headers=["*"], expose_headers=[REPLICA_HEADER])
            self._origins = origins
        return await self._cors(scope, receive, send)


api.add_middleware(_CORS)         # added last: the outermost


def _answer(err: APIError, headers: dict | None = None) -> JSONResponse:
    """An error response in the envelope, counted on /metrics by status."""
    if _replica:
        _replica[0].recorder.error(err.status)
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError):
    return _answer(validation_error(exc.errors()))


def validation_error(errors: list[dict]) -> APIError:
    """pydantic's errors as one 400 naming the field (``messages[0].content``), never the
    server's code (str(exc) would carry its source path). A field of several types (``prompt``)
    fails once per type: then the message lists the types, not the first one's complaint."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":         # loc ("body", offset): a place in the text, no field
        where = first.get("loc", ())[1:2]
        return APIError(400, f"the request body is not valid JSON ({first.get('ctx', {}).get('error', 'a decode error')}"
                             f"{f' at character {where[0]}' if where else ''})", "invalid_request_error", None)
    loc = [x for x in first.get("loc", ())[1:] if not _is_type_tag(x)]
    param = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".") or None
    msg = first.get("msg", "invalid request")
    if param is None:
        return APIError(400, f"the request body must be a JSON object with the API's fields ({msg})",
                        "invalid_request_error", None)
    types = [str(e["loc"][2]) for e in errors if len(e.get("loc", ())) > 2 and e["loc"][1] == first["loc"][1]
             and _is_type_tag(e["loc"][2])]
    if len(set(types)) > 1:
        field = str(first["loc"][1])
        return APIError(400, f"{field} must be one of: {', '.join(dict.fromkeys(types))} (JSON numbers for "
                             f"numbers: no booleans or numeric strings)", "invalid_request_error", field)
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"{param} is not a field this server supports (it refuses what it would "
                             f"otherwise ignore)", "invalid_request_error", param, "unsupported_parameter")
    return APIError(400, f"{param}: {msg}", "invalid_request_error", param)


def _is_type_tag(part) -> bool:
    """pydantic's name for one branch of a union in an error's location (``str``, ``list[int]``)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "list", "dict", "none")
                                      or "[" in part or part.startswith("function-"))


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException):
    """Unknown paths (404), wrong methods (405) and the like: the envelope, not FastAPI's body."""
    message = {404: f"no route {request.method} {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return _answer(APIError(exc.status_code, message, "invalid_request_error", None, code))


@api.exception_handler(APIError)
async def _api_error(request: Request, exc: APIError):
    return _answer(exc)


class OpenAIRoutes:
    """HTTP routes over the worker's ``open`` / ``run`` (see ``worker.Worker``)."""

    @api.get("/health")
    async def health(self):
        if self.loop.failed is not None:
            return JSONResponse({"status": "failed", "error": repr(self.loop.failed)}, status_code=503)
        return {"status": "ok", "replica": self.replica_id}

    @api.get("/metrics")
    async def metrics(self):
        return Response(await self.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @api.get("/v1/models")
    async def models(self, request: Request):
        self._authorize(request)
        return {"object": "list", "data": [self._model_card()]}

    @api.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request):
        self._authorize(request)
        try:
            self._check_model(model_id)
        except APIError as e:
            return self._error(e)
        return self._model_card()

    @api.get("/version")
    async def version(self):
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as package_version
        try:
            return {"version": package_version("mtpserve")}
        except PackageNotFoundError:       # run from a checkout without installing it
            return {"version": "unknown"}

    @api.post("/tokenize")
    async def tokenize(self, body: TokenizeRequest):
        """vLLM's /tokenize: {count, max_model_len, tokens} of a prompt or of chat messages."""
        try:
            self._check_model(body.model)
            if (body.prompt is None) == (body.messages is None):
                raise APIError(400, "give exactly one of prompt and messages", param="prompt")
            if body.messages is not None:
                msgs = messages_as_dicts(body.messages, self.tokenizer.renders_names)
                try:
                    text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=body.add_generation_prompt)
                except ValueError as e:
                    raise APIError(400, str(e), param="messages") from None
                tokens = await self._encode(text, "messages")
            else:
                tokens = await self._encode(body.prompt, "prompt")
        except APIError as e:
            return self._error(e)
        return {"count": len(tokens), "max_model_len": self.context_length, "tokens": tokens}

    @api.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest):
        """vLLM's /detokenize: {prompt} of token ids."""
        try:
            self._check_model(body.model)
            vocab = self.limits.vocab_size
            if any(not 0 <= t < vocab for t in body.tokens):
                raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        except APIError as e:
            return self._error(e)
        return {"prompt": self.tokenizer.decode(body.tokens)}

    def _token_text(self, token_id: int) -> str:
        """One token as text, for logprobs (a token that is part of a character decodes to U+FFFD)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "mtpserve",
                "max_model_len": self.context_length}

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        try:
            self._check(body)
            given = body.prompts()
            vocab = self.limits.vocab_size
            if any(not 0 <= t < vocab for p in given if not isinstance(p, str) for t in p):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            prompts = [await self._encode(p, "prompt") if isinstance(p, str) else list(p) for p in given]
            await self._compile_grammar(body)
            echo = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in given] if body.echo else None
            return await self._respond(body, prompts, request, chat=False, echo=echo)
        except APIError as e:
            return self._error(e)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        try:
            self._check(body)
            tools = body.tools_to_render()
            try:
                text = self.tokenizer.apply_chat_template(body.messages_as_dicts(self.tokenizer.renders_names), tools=tools)
            except ValueError as e:
                raise APIError(400, str(e), param="tools" if tools and not self.tokenizer.renders_tools
                               else "messages") from None
            ids = await self._encode(text, "messages")
            await self._compile_grammar(body)
            return await self._respond(body, [ids], request, chat=True)
        except APIError as e:
            return self._error(e)

    # ------------------------------------------------------------------ helpers
    async def _compile_grammar(self, body) -> None:
        """A request's structured-output grammar compiled (on a thread, into the engine's cache)
        before it is queued: one that does not compile is a 400 naming its field."""
        spec = body.grammar_spec()
        if spec is not None:
            try:
                await asyncio.to_thread(self.grammar_compiler.compile, spec)
            except ValueError as e:
                raise APIError(400, str(e), param=spec.param) from None

    def _tool_answer(self, body, text: str, ids: list[int], finish: str) -> tuple[str | None, list[dict], str]:
        """(content, tool_calls, finish_reason) of a chat choice when tools are offered: the calls
        parsed from its output (special tokens kept, the ending stop id dropped). A clean stop
        with calls answers "tool_calls", but "stop" under a named tool_choice, as OpenAI's API
        does streamed and not (vLLM aligned with it too: vllm-project/vllm #25054)."""
        eos = self.manifest.eos_token_ids
        while ids and ids[-1] in eos:
            ids = ids[:-1]
        mode = body.tool_mode
        named = body.tool_choice.function.name if mode == "named" else None
        raw = self.tokenizer.decode(ids, skip_special_tokens=False)
        content, calls = parse_tool_calls(raw, mode, named, set(body.tool_schemas()))
        if body.parallel_tool_calls is False:
            calls = calls[:1]
        if not calls:
            return text, [], finish
        return content, calls, "tool_calls" if finish == "stop" and mode != "named" else finish

    async def _encode(self, text: str, param: str) -> list[int]:
        """Token ids of a text: refused at once when it cannot fit the context whatever its tokens;
        a long one is tokenized on a thread, so /health and other streams keep being served."""
        _require_unicode(text, param)
        size = len(text.encode("utf-8"))
        if size > self.context_length * self.tokenizer.max_bytes_per_token:
            raise APIError(400, f"the {param} is {size} bytes: more than the model's context of "
                                f"{self.context_length} tokens can hold", param=param)
        if size < 1 << 16:
            return self.tokenizer.encode(text)
        return await asyncio.to_thread(self.tokenizer.encode, text)

    def _authorize(self, request: Request) -> None:
        """For GET routes: a POST's key was checked before its body was read (``_RefuseEarly``)."""
        err = _auth_error(self.api_key, request.headers.get("authorization"))
        if err is not None:
            raise err

    def _check(self, body) -> None:
        self._check_model(body.model)
        body.refuse_unsupported()

    def _check_model(self, model: str | None) -> None:
        """A request names the served model, or none (then it is the one served)."""
        if model is None:
            return
        _require_unicode(model, "model")
        if model != self.model_name:
            raise APIError(404, f"the model `{model}` does not exist; this server serves "
                                f"`{self.model_name}`", "invalid_request_error", "model", "model_not_found")

    def _error(self, e: APIError) -> JSONResponse:
        return _answer(e, {REPLICA_HEADER: self.replica_id})

    async def _respond(self, body, prompts: list[list[int]], request: Request, chat: bool,
                       echo: list[str] | None = None):
        """Run every (prompt, choice) and answer whole or as SSE; ``echo``: the prompts' texts,
        put before each choice's text (completions' echo)."""
        started = time.perf_counter()
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if len(prompts) * body.n > self.config.max_pending:      # could never all be admitted: not a retryable 429
            raise APIError(400, f"{len(prompts)} prompts x n={body.n} is more than the {self.config.max_pending} "
                                f"requests a replica queues", param="prompt" if not chat else "n")
        params = []
        for ids in prompts:
            max_tokens = body.max_tokens
            if chat and body.max_completion_tokens is not None:
                max_tokens = body.max_completion_tokens
            if max_tokens is None:
                max_tokens = self.max_new_tokens(len(ids))
            else:
                try:
                    self.check_context(len(ids), max_tokens)
                except ValueError as e:
                    limit = "max_completion_tokens" if chat and body.max_completion_tokens is not None else "max_tokens"
                    raise APIError(400, str(e), param=("messages" if chat else "prompt") if len(ids) >= self.context_length
                                   else limit) from None
            params.append([body.sampling_params(max_tokens, c) for c in range(body.n)])
        try:                                       # named, and before any stream opens
            check_token_ids(params[0][0], self.limits.vocab_size)
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split(" ", 1)[0]) from None
        session_id = request.headers.get(SESSION_HEADER)
        if session_id is not None and len(session_id) > MAX_SESSION_ID_LENGTH:
            raise APIError(400, f"{SESSION_HEADER} is longer than {MAX_SESSION_ID_LENGTH} characters",
                           param=SESSION_HEADER)
        try:
            streams = await self.open(request_id, prompts, params, session_id)
        except ValueError as e:
            raise APIError(400, str(e), param="prompt" if not chat else "messages") from None
        except Overloaded as e:
            raise APIError(429, str(e), "rate_limit_error", None, "overloaded") from None
        except EngineFailed as e:
            raise APIError(503, str(e), "server_error", None, "unavailable") from None
        headers = {REPLICA_HEADER: self.replica_id}
        num_prompt_tokens = sum(len(p) for p in prompts)
        if body.stream:
            events = self._sse(request_id, body, streams, chat, num_prompt_tokens, started, prompts, echo,
                               paced=request.headers.get(VIA_PROXY_HEADER) is not None)
            # a client gone before the body starts leaves the generator un-iterated: abort on collection
            weakref.finalize(events, _cancel_all, streams)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        texts, finish, num_out = [""] * len(streams), ["stop"] * len(streams), [0] * len(streams)
        cached, out_ids, scored = [0] * len(streams), [[] for _ in streams], [[] for _ in streams]
        prompt_scored = [[] for _ in streams]
        try:
            async for i, event in self.run(streams, started):
                texts[i] += event.text
                out_ids[i] += event.token_ids
                scored[i] += event.logprobs or []
                if event.prompt_logprobs is not None:
                    prompt_scored[i] = event.prompt_logprobs
                if event.finish_reason is not None:
                    finish[i], num_out[i] = event.finish_reason.value, event.num_output_tokens
                    cached[i] = event.num_cached_tokens
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None
        except EngineFailed as e:
            raise APIError(503, str(e), "server_error", None, "unavailable") from None
        ids = (out_ids, _per_choice(prompts, body.n)) if body.return_token_ids else (None, None)
        lps = None
        if chat and body.num_logprobs is not None:
            lps = [chat_logprobs(e, self._token_text, self.tokenizer.token_bytes) for e in scored]
        elif body.num_logprobs is not None:
            lps = []
            for i, entries in enumerate(scored):
                head = echo_logprobs(prompts[i // body.n][0], prompt_scored[i], self._token_text) if echo else None
                start = head["text_offset"][-1] + len(head["tokens"][-1]) if head else 0
                tail = completion_logprobs(entries, self._token_text, start)
                lps.append(joined_logprobs(head, tail) if head else tail)
        if echo:
            texts = [echo[i // body.n] + t for i, t in enumerate(texts)]
        calls = None
        if chat and body.tool_mode != "none":
            answers = [self._tool_answer(body, t, o, f) for t, o, f in zip(texts, out_ids, finish)]
            texts, calls, finish = [a[0] for a in answers], [a[1] for a in answers], [a[2] for a in answers]
        return JSONResponse(completion_body(request_id, self.model_name, texts, finish,
                                            usage(num_prompt_tokens, sum(num_out), _prompt_cached(cached, body.n)),
                                            chat, *ids, lps, tool_calls=calls), headers=headers)

    async def _sse(self, request_id: str, body, streams, chat: bool, num_prompt_tokens: int, started: float,
                   prompts: list[list[int]], echo: list[str] | None = None, paced: bool = False):
        with_usage = body.include_usage
        chunks = SSEChunks(request_id, self.model_name, int(time.time()), chat, with_usage)
        num_out, cached = [0] * len(streams), [0] * len(streams)
        with_ids, with_logprobs = body.return_token_ids, body.num_logprobs is not None
        prompt_ids = _per_choice(prompts, body.n) if with_ids else None     # each sent once, then None
        offsets = [0] * len(streams)                                         # completions' text_offset
        echoed = [False] * len(streams)
        # with tools offered, a choice's text streams until a tool call starts (tool_choice auto:
        # the <tool_call> token; required / named: at once), then is held back until its end and
        # sent as delta.tool_calls (parsed from the whole output), or as content if none parses
        tool_mode = body.tool_mode if chat else "none"
        call_token = self.tokenizer.token_id("<tool_call>") if tool_mode == "auto" else None
        held = [tool_mode in ("named", "required")] * len(streams)
        sent_text, held_text, out_ids = [""] * len(streams), [""] * len(streams), [[] for _ in streams]
        try:
            if chat:
                for i in range(len(streams)):
                    choice = chunk_choice(i, "", None, chat, first=True)
                    if with_ids:
                        choice["token_ids"], choice["prompt_token_ids"], prompt_ids[i] = [], prompt_ids[i], None
                    yield chunks.chunk([choice])
            async for i, event in self.run(streams, started, paced):
                reason = None if event.finish_reason is None else event.finish_reason.value
                if reason is not None:
                    num_out[i], cached[i] = event.num_output_tokens, event.num_cached_tokens
                first = echo is not None and not echoed[i]                      # an echoed choice's first chunk
                echoed[i] = echoed[i] or first
                event_text, calls = event.text, None
                if tool_mode != "none":
                    out_ids[i] += event.token_ids
                    if held[i]:
                        held_text[i], event_text = held_text[i] + event_text, ""
                    elif call_token is not None and call_token in event.token_ids:
                        event_text, held_text[i] = split_at_tool_call(event.token_ids, event_text, call_token,
                                                                      self.tokenizer.decode)
                        held[i] = True
                    if reason is not None:
                        _, calls, reason = self._tool_answer(body, sent_text[i] + event_text + held_text[i],
                                                             out_ids[i], reason)
                        if not calls:             # nothing parsed: what was held back is content after all
                            event_text += held_text[i]
                    sent_text[i] += event_text
                if event_text or reason is not None or first or ((with_ids or with_logprobs) and event.token_ids):
                    text = (echo[i // body.n] if first else "") + event_text
                    choice = chunk_choice(i, text or (None if chat else ""), reason, chat)
                    if calls:
                        choice["delta"]["tool_calls"] = tool_call_deltas(calls)
                    if with_logprobs and event.logprobs:
                        if chat:
                            choice["logprobs"] = chat_logprobs(event.logprobs, self._token_text, self.tokenizer.token_bytes)
                        else:
                            head = echo_logprobs(prompts[i // body.n][0], event.prompt_logprobs or [],
                                                 self._token_text) if first else None
                            if head:
                                offsets[i] = head["text_offset"][-1] + len(head["tokens"][-1])
                            lp = completion_logprobs(event.logprobs, self._token_text, offsets[i])
                            choice["logprobs"] = joined_logprobs(head, lp) if head else lp
                            offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                    if with_ids:
                        choice["token_ids"] = list(event.token_ids)
                        if prompt_ids[i] is not None:
                            choice["prompt_token_ids"], prompt_ids[i] = prompt_ids[i], None
                    yield chunks.chunk([choice])
            if with_usage:
                yield chunks.usage_chunk(usage(num_prompt_tokens, sum(num_out), _prompt_cached(cached, body.n)))
        except (EngineFailed, ValueError) as e:
            err = APIError(400, str(e), param="prompt") if isinstance(e, ValueError) else \
                APIError(503, str(e), "server_error", None, "unavailable")
            self.recorder.error(err.status)
            yield f"data: {json.dumps(err.body())}\n\n"
        finally:
            _cancel_all(streams)
        yield SSE_DONE


def _require_unicode(text: str, param: str) -> None:
    """JSON may carry lone surrogates ("\\ud800"), which are no text: a 400 naming the field."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param} is not valid Unicode (a lone surrogate at character {e.start})",
                       param=param) from None


def api_key_matches(authorization: str | None, api_key: str) -> bool:
    """``Authorization: Bearer <key>``, the scheme in any case (RFC 7235), the key compared in
    constant time (no timing signal of how much of a guess was right)."""
    scheme, _, given = (authorization or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), api_key.encode())


def _prompt_cached(cached: list[int], n: int) -> int:
    """Cached prompt tokens of a response: each prompt counted once (its first choice's), as
    prompt_tokens counts each prompt once for n choices."""
    return sum(cached[::n])


def _per_choice(prompts: list[list[int]], n: int) -> list[list[int]]:
    """Each choice's prompt ids, in the streams' order (prompt-major, n choices each)."""
    return [list(ids) for ids in prompts for _ in range(n)]


def _cancel_all(streams) -> None:
    """Abort every request of a response that will not be read to its end (no-op once finished)."""
    for stream in streams:
        stream.cancel()

"""An OpenAI-compatible HTTP API over a SpecDecoder: /v1/models, /v1/chat/completions, /v1/completions."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from ..api import SpecDecoder
from ..approximate import CompressedPrompt
from ..engine import Stats, check_prompt, decode_steps
from ..errors import SpecDecodeError
from ..sampling import SamplingParams
from ..text import TextAssembler
from .scheduler import DONE, Scheduler

log = logging.getLogger("specdecode.serve")
MAX_BODY_BYTES = 8 << 20  # a request body larger than this gets a 413 before it is read in full


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str = Field(pattern="^(system|developer|user|assistant)$")
    content: str | list[dict]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")


class SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(1, ge=1, le=1)
    stream: bool = False

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatRequest(SamplingRequest):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(SamplingRequest):
    prompt: str


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None, code=None):
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


def internal_error(exc: Exception) -> dict:
    """The OpenAI error body of a failure inside the server (a drafter or model that raised); logged with its
    traceback, since the client gets one line."""
    log.error("request failed", exc_info=exc)
    return error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error")


class BodyLimit:
    """ASGI middleware: a request body over max_bytes gets a 413 with an OpenAI error body without being read in full,
    at once when its Content-Length says so, else as soon as the bytes received pass the limit. (Starlette's own
    limit answers in plain text.)"""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes
        self.message = f"the request body is larger than this server takes ({max_bytes} bytes)"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await error(413, self.message)(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise HTTPException(413, self.message)  # FastAPI passes it on to http_error below
            return message

        await self.app(scope, limited_receive, send)


def create_app(
    decoder: SpecDecoder, model_name: str, api_key: str | None = None, default_max_tokens: int = 512,
    max_batch: int = 8, max_body_bytes: int = MAX_BODY_BYTES,
):
    app = FastAPI(title="specdecode", version="0.1")
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    scheduler = Scheduler(decoder.target, max_batch)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        """FastAPI's own refusals (a body that is not UTF-8, too large, an unknown path) as OpenAI error bodies."""
        if isinstance(exc.__cause__, HTTPException):  # BodyLimit's 413, wrapped by FastAPIs that wrap it
            exc = exc.__cause__
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(Exception)
    async def server_error(request, exc: Exception):
        return JSONResponse(internal_error(exc), status_code=500)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", [])[1:]) or None
        return error(400, f"{param or 'request'}: {first.get('msg', 'invalid request')}", param=param)

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            if not secrets.compare_digest(given, api_key):
                return error(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")
        return await call_next(request)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "specdecode"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "active_requests": scheduler.active, "cache_slots": scheduler.slots,
                "max_batch": scheduler.max_batch, "batches": scheduler.batches,
                "batched_requests": scheduler.batched_requests,
                "prefix_cache": decoder.prefix_cache.stats() if decoder.prefix_cache is not None else None}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        return await complete(body, request, lambda: decoder.encode(messages, chat=True), chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await complete(body, request, lambda: decoder.encode(body.prompt), chat=False)

    async def complete(body: SamplingRequest, request: Request, encode, chat: bool):
        if body.model not in (None, model_name):
            return error(404, f"model '{body.model}' is not served here; this server serves '{model_name}'",
                         param="model", code="model_not_found")
        try:
            prompt_ids = encode()
            max_tokens = body.max_completion_tokens or body.max_tokens or default_max_tokens
            check_prompt(decoder.target, len(prompt_ids), max_tokens)
            params = SamplingParams(body.temperature, body.top_k, body.top_p, body.seed)
        except SpecDecodeError as exc:
            return error(400, str(exc))
        if decoder.compressor is None:
            compressed = decoder.compress_prompt(prompt_ids)  # the prompt as it is
        else:  # --approximate: the draft model's read of the prompt, off the event loop
            compressed = await run_in_threadpool(decoder.compress_prompt, prompt_ids)
        run = Run(decoder, scheduler, compressed, max_tokens, params, body.stops())
        builder = ResponseBuilder(chat, model_name, len(prompt_ids))
        if body.stream:
            return StreamingResponse(sse(run, builder), media_type="text/event-stream")
        try:
            text = await run.answer(request)
        except SpecDecodeError as exc:
            return error(400, str(exc))
        except Exception as exc:  # a drafter or the model raised: its slot is already freed
            return JSONResponse(internal_error(exc), status_code=500)
        if run.cancelled:
            return error(499, "client closed the request")
        headers = {"x-specdecode-tau": f"{run.stats.tau:.3f}"}
        return JSONResponse(builder.response(text, run), headers=headers)

    return app


class Run:
    """One request: its decode loop in the worker thread (which batches its forwards with other requests'), its text
    assembled here as steps arrive."""

    def __init__(self, decoder, scheduler, prompt: CompressedPrompt, max_tokens, params, stops):
        self.stats = Stats()
        self.text = TextAssembler(decoder.tokenizer, stops)
        self.finish_reason = "length"
        self.cancelled = False
        self.mark = lambda: decoder.mark_approximate(self.stats, prompt)
        steps = decode_steps(decoder.target, decoder.new_drafter(), prompt.token_ids, max_tokens, params, self.stats,
                             prefix_cache=decoder.prefix_cache)  # restored and stored in the worker thread
        self.queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self.job = scheduler.submit(steps, lambda item: loop.call_soon_threadsafe(self.queue.put_nowait, item))

    async def answer(self, request: Request) -> str:
        """The whole text, for a response sent at the end; the job is cancelled as soon as the client goes away
        (Request.is_disconnected cannot see that behind an http middleware, so a task waits for the message)."""
        watch = asyncio.ensure_future(self._cancel_on_disconnect(request))
        try:
            return "".join([piece async for piece in self.pieces()])
        finally:
            watch.cancel()

    async def _cancel_on_disconnect(self, request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.cancelled = True
        self.queue.put_nowait(DONE)  # ends pieces(), which cancels the job

    async def pieces(self) -> AsyncIterator[str]:
        try:
            while True:
                item = await self.queue.get()
                if self.cancelled:
                    return
                if item is DONE:
                    self.mark()
                    self.finish_reason = self.stats.finish_reason or "length"
                    if rest := self.text.flush():
                        yield rest
                    return
                if isinstance(item, Exception):
                    raise item
                piece = self.text.add(item)
                if piece:
                    yield piece
                if self.text.stopped:
                    self.finish_reason = "stop"
                    return
        finally:
            self.job.cancel()  # no-op once finished; frees the caches of an abandoned or stopped request


class ResponseBuilder:
    def __init__(self, chat: bool, model: str, prompt_tokens: int):
        self.chat, self.model, self.prompt_tokens = chat, model, prompt_tokens
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def usage(self, run: Run) -> dict:
        """OpenAI's usage; prompt_tokens_details.cached_tokens counts the prompt tokens whose KV came from the
        prefix cache (as OpenAI counts its own prompt caching)."""
        completion = run.stats.new_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": run.stats.reused_prompt_tokens}}

    @staticmethod
    def speculative(run: Run) -> dict:
        s = run.stats
        out = {"tau": s.tau, "target_forwards": s.target_forwards, "drafted_tokens": s.drafted_tokens,
               "accepted_tokens": s.accepted_tokens, "seconds": s.seconds}
        if s.approximate:  # --approximate shortened this prompt: the answer is not plain decoding's
            out.update(approximate=s.approximate, prompt_tokens_read=s.prompt_tokens_read)
        return out

    def response(self, text: str, run: Run) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": run.finish_reason}
        else:
            choice = {"index": 0, "text": text, "finish_reason": run.finish_reason, "logprobs": None}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage(run),
                "speculative": self.speculative(run)}

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice]}


async def sse(run: Run, builder: ResponseBuilder) -> AsyncIterator[str]:
    """Server-sent events; the final chunk carries usage and the speculative statistics."""
    yield f"data: {json.dumps(builder.chunk('', first=True))}\n\n"
    try:
        async for piece in run.pieces():
            yield f"data: {json.dumps(builder.chunk(piece))}\n\n"
    except SpecDecodeError as exc:
        yield f"data: {json.dumps(error_body(str(exc)))}\n\n"
        return
    except Exception as exc:  # a drafter or the model raised mid-stream: the status line is sent, so say it here
        yield f"data: {json.dumps(internal_error(exc))}\n\n"
        return
    finally:
        run.job.cancel()  # the client went away mid-stream: stop decoding and free the caches
    final = builder.chunk(None, run.finish_reason)
    final.update(usage=builder.usage(run), speculative=builder.speculative(run))
    yield f"data: {json.dumps(final)}\n\n"
    yield "data: [DONE]\n\n"

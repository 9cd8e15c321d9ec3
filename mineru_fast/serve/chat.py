"""The OpenAI-compatible chat API, as MinerU's own clients call a VLM server.

mineru-vl-utils' ``http-client`` backend (what mineru 4.x uses to reach a remote VLM) sends
``POST {server}/v1/chat/completions`` with a system message and a user message holding one image
(``image_url`` with a ``data:`` URL) and the task prompt (image first unless its
``text_before_image`` is set), plus ``temperature``, ``top_p``, ``top_k``, ``presence_penalty``,
``frequency_penalty``, ``repetition_penalty``, ``vllm_xargs.no_repeat_ngram_size``,
``max_tokens`` / ``max_completion_tokens``, ``skip_special_tokens`` and an optional ``priority``;
it reads ``choices[0].message.content`` and ``finish_reason`` (``stop`` or ``length``), and finds
the model's name with ``GET {server}/v1/models``. This module turns such a request into a
``GenerationRequest`` for the shared engine and its result into the response.

Decoding is greedy, with the same rules (``engine.sampling``) as the parser's own requests: the
request must ask for greedy decoding (``temperature`` 0, or ``top_k`` 1; MinerU sends both).
``stop`` strings end the output (the answer stops before the first one, as on vLLM). What this
server cannot do is refused with ``400 unsupported_parameter``, never ignored: ``logprobs`` /
``top_logprobs``, ``tools`` / ``tool_choice`` / ``functions``, ``logit_bias``, a
``response_format`` other than text. Message text is text: control tokens typed in it
(``<|im_start|>``, ``<|image_pad|>``) are characters (see ``engine.preprocess``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import secrets
import threading
import time
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from PIL import Image
from prometheus_client import Gauge
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from ..engine.base import GenerationRequest, GenerationResult, RequestHandle
from ..errors import InputError
from ..inputs import open_document
from ..protocol import FLOAT32_MAX, SYSTEM_PROMPT, SamplingParams
from .errors import ApiError
from .jobs import CostBudget

if TYPE_CHECKING:
    from .service import Service

__all__ = [
    "ChatRequest",
    "ChatImageDecoder",
    "ChatSlots",
    "to_generation_request",
    "completion_body",
    "stream_chunks",
    "models_body",
    "add_chat_routes",
]


class _Part(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    image_url: dict[str, Any] | str | None = None


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[_Part] | None = None


MAX_STOPS, MAX_STOP_CHARS = 4, 256  # stop strings per request (OpenAI's bound) and characters in one
_Stop = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class ChatRequest(BaseModel):
    """The body of ``POST /v1/chat/completions`` (fields MinerU's clients send; others ignored)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[_Message] = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2, allow_inf_nan=False)
    repetition_penalty: float | None = Field(default=None, gt=0, le=FLOAT32_MAX, allow_inf_nan=False)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    min_tokens: int = Field(default=0, ge=0)
    skip_special_tokens: bool = True
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1)
    priority: int = 0
    vllm_xargs: dict[str, Any] | None = None
    stop: _Stop | Annotated[list[_Stop], Field(max_length=MAX_STOPS)] | None = None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple (empty when unset)."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


# Parameters of the OpenAI chat API this server does not implement, and the values that mean "off".
_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
}


def _text_of(content: str | list[_Part] | None) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.text or "" for p in content or [] if p.type == "text")


class ChatImageDecoder:
    """Decodes a chat request's image within the service's decode budget (the one the jobs use).

    The image's header is read first, nothing decoded: its cost (``OpenedDocument.page_cost``:
    the peak bytes of decoding it) is taken from the budget before a pixel is decoded, and after
    decoding only the rendered RGB image's bytes stay taken, until ``release`` (called when the
    request has ended, whatever the outcome).

    Args:
        budget: the service's ``CostBudget`` (bytes).
        max_pixels: the largest image accepted (``ParserOptions.max_image_pixels``).
    """

    def __init__(self, budget: CostBudget, max_pixels: int) -> None:
        self.budget, self.max_pixels = budget, max_pixels
        self._held = 0
        self._lock = threading.Lock()

    def __call__(self, data: bytes) -> Image.Image:
        """The RGB image in ``data`` (long side at most ``inputs.DEFAULT_MAX_SIDE``).

        Raises:
            ApiError: 400 ``bad_image`` for a PDF or more than one frame, 413 ``image_too_large`` when it
                alone needs more than the budget, 429 ``over_capacity`` (``Retry-After``) when the
                budget is in use; 422 ``bad_image`` for an undecodable image.
        """
        try:
            with open_document(data, max_pixels=self.max_pixels, decode_first=False) as opened:
                if opened.format == "pdf":
                    raise ApiError(
                        400, "bad_image", "image_url holds a PDF, not an image (send the page as PNG or JPEG)"
                    )
                if opened.page_count != 1:
                    raise ApiError(400, "bad_image", f"the image must have one frame, it has {opened.page_count}")
                peak, kept = opened.page_cost(0)
                self._take(peak)
                try:
                    image = opened.render(0)
                finally:
                    self._give_back(peak - kept)
                return image
        except InputError as exc:
            raise ApiError(422, "bad_image", f"the image cannot be used: {exc}") from exc

    def _take(self, cost: int) -> None:
        limit = self.budget.limit
        if limit is not None and cost > limit:
            raise ApiError(
                413,
                "image_too_large",
                f"decoding the image needs {cost / 2**20:,.0f} MiB; this server's budget is {limit / 2**20:,.0f} MiB",
            )
        if not self.budget.take(cost):
            raise ApiError(
                429, "over_capacity", "the server's decode budget is in use; retry in 1 s", {"Retry-After": "1"}
            )
        with self._lock:
            self._held += cost

    def _give_back(self, cost: int) -> None:
        with self._lock:
            cost = min(cost, self._held)
            self._held -= cost
        self.budget.release(cost)

    def release(self) -> None:
        """Give back what this request still holds (idempotent)."""
        with self._lock:
            held, self._held = self._held, 0
        self.budget.release(held)


def _image_from_url(url: str, decode: ChatImageDecoder) -> Image.Image:
    """Decode a ``data:image/...;base64,`` URL into an RGB image (``decode``).

    Raises:
        ApiError: 400 for another URL scheme or bad base64; as ``ChatImageDecoder`` for the image.
    """
    if not url.startswith("data:") or ";base64," not in url[:100]:
        raise ApiError(
            400, "unsupported_image_url", "image_url must be a base64 data: URL (remote URLs are not fetched)"
        )
    try:
        data = base64.b64decode(url.split(";base64,", 1)[1], validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, "bad_image_url", "image_url holds invalid base64") from None
    return decode(data)


def to_generation_request(body: ChatRequest, max_new_tokens: int, decode: ChatImageDecoder) -> GenerationRequest:
    """The engine request of a chat request.

    Args:
        body: the validated request.
        max_new_tokens: the server's bound on generated tokens; used when the request sets none,
            and a larger request is refused.
        decode: decodes the image within the service's budget (last, once the rest is checked).

    Raises:
        ApiError: 400 for anything this server cannot do as asked (not exactly one image, a
            remote image URL, sampling other than greedy, a bound above the server's, a parameter
            it does not implement, sampling values the engine cannot hold).
    """
    extra = body.model_extra or {}
    for name, off in _UNSUPPORTED.items():
        if extra.get(name) not in off:
            raise ApiError(400, "unsupported_parameter", f"{name} is not supported by this server")
    system = "".join(_text_of(m.content) for m in body.messages if m.role in ("system", "developer"))
    users = [m for m in body.messages if m.role == "user"]
    if len(users) != 1 or any(m.role == "assistant" for m in body.messages):
        raise ApiError(400, "unsupported_messages", "send one user message (and optionally a system message)")
    parts = [_Part(type="text", text=users[0].content)] if isinstance(users[0].content, str) else users[0].content or []
    images = [i for i, p in enumerate(parts) if p.type == "image_url"]
    if len(images) != 1:
        raise ApiError(
            400, "unsupported_messages", f"the user message must hold exactly one image, it has {len(images)}"
        )
    url = parts[images[0]].image_url
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str):
        raise ApiError(400, "bad_image_url", "image_url.url must be a string")
    greedy = body.temperature in (None, 0) or body.top_k == 1
    if not greedy:
        raise ApiError(400, "unsupported_sampling", "only greedy decoding is served: set temperature 0 or top_k 1")
    bound = body.max_completion_tokens or body.max_tokens or max_new_tokens
    if bound > max_new_tokens:
        raise ApiError(400, "max_tokens_too_large", f"max_tokens may be at most {max_new_tokens} on this server")
    ngram = (body.vllm_xargs or {}).get("no_repeat_ngram_size") or 0
    if not isinstance(ngram, int) or ngram < 0:
        raise ApiError(400, "bad_request", "vllm_xargs.no_repeat_ngram_size must be an integer >= 0")
    try:
        sampling = SamplingParams(
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=body.repetition_penalty or 1.0,
            no_repeat_ngram_size=ngram,
            max_new_tokens=bound,
            min_new_tokens=min(body.min_tokens, bound),
        )
    except ValueError as exc:
        raise ApiError(400, "bad_request", str(exc)) from None
    text_parts = [p.text or "" for p in parts if p.type == "text"]
    text_before = any(p.type == "text" for p in parts[: images[0]])
    return GenerationRequest(
        image=_image_from_url(url, decode),
        prompt="".join(text_parts),
        sampling=sampling,
        system=system or SYSTEM_PROMPT,
        text_before_image=text_before,
        priority=body.priority,
        stop=body.stop_strings,
    )


def _finish_reason(result: GenerationResult) -> str:
    return "stop" if result.finish_reason == "stop" else "length"


def completion_body(result: GenerationResult, text: str, model: str) -> dict:
    """The ``chat.completion`` object of a finished request (``text`` as the client asked it
    decoded: with or without special tokens)."""
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": _finish_reason(result),
            }
        ],
        "usage": {
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": len(result.token_ids),
            "total_tokens": result.prompt_tokens + len(result.token_ids),
        },
    }


def stream_chunks(result: GenerationResult, text: str, model: str) -> list[dict]:
    """The ``chat.completion.chunk`` events of a streamed answer: the role, the text, the finish
    reason with usage (the text arrives in one piece, when it is done)."""
    base = {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion.chunk", "created": int(time.time())}
    base["model"] = model
    usage = completion_body(result, text, model)["usage"]
    return [
        {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": _finish_reason(result)}], "usage": usage},
    ]


def models_body(model: str) -> dict:
    """``GET /v1/models``: the one served model."""
    return {
        "object": "list",
        "data": [
            {
                "id": model,
                "object": "model",
                "created": 0,
                "owned_by": "mineru-fast",
            }
        ],
    }


class ChatSlots:
    """The chat door's bound on requests in flight: ``acquire`` never waits.

    Args:
        limit: requests in flight at most (``ServeConfig.max_chat_requests``).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_use = 0
        self._lock = threading.Lock()

    def acquire(self) -> bool:
        """Take a slot; False when all ``limit`` are taken."""
        with self._lock:
            if self.in_use >= self.limit:
                return False
            self.in_use += 1
            return True

    def release(self) -> None:
        """Give a slot back (once per successful ``acquire``).

        Raises:
            RuntimeError: no slot is taken.
        """
        with self._lock:
            if self.in_use == 0:
                raise RuntimeError("chat slot released more often than acquired")
            self.in_use -= 1


def add_chat_routes(app: FastAPI, service: Service) -> None:
    """``POST /v1/chat/completions`` and ``GET /v1/models`` on the service's shared engine.

    Requests skip the job queue (as on a vLLM server): each is one engine request, batched with
    the parse jobs' requests; at most ``max_chat_requests`` are in flight (``429`` beyond; the slots
    are ``app.state.chat_slots``, exported as ``mineru_fast_chat_requests_in_flight``). A slot is
    given back on every path (answer, refusal, engine error, disconnect, cancellation); a client
    that disconnects, or a handler cancelled, has its engine request cancelled. Keys, limits,
    metrics and errors are the service's.
    """
    slots = app.state.chat_slots = ChatSlots(service.config.max_chat_requests)
    registry = service.metrics.registry
    gauge = Gauge("mineru_fast_chat_requests_in_flight", "Chat completions in flight", registry=registry)
    gauge.set_function(lambda: float(slots.in_use))
    decoding = asyncio.Semaphore(service.config.workers)  # images decoded at once (CPU), each within the budget

    @app.get("/v1/models")
    async def models() -> dict:
        """The served model (MinerU's clients read its id)."""
        service.require_ready()
        return models_body(service.info["model"])

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request, body: ChatRequest) -> JSONResponse | StreamingResponse:
        """One image + prompt decoded greedily by the shared engine (OpenAI chat format)."""
        parser = service.require_parser()
        decoder = ChatImageDecoder(service.require_ready().budget, parser.options.max_image_pixels)
        if not slots.acquire():
            raise ApiError(429, "too_many_chat_requests", "too many chat requests in flight", {"Retry-After": "1"})
        try:
            options = parser.options
            bound = max(options.sampling(task).max_new_tokens for task in ("layout", "text", "table", "equation"))
            async with decoding:
                engine_request = await run_in_threadpool(to_generation_request, body, bound, decoder)
            handle = await run_in_threadpool(parser.engine.submit, engine_request)
            result = await _wait_or_cancel(request, handle)
        finally:
            decoder.release()
            slots.release()
        if result.finish_reason == "error":
            raise ApiError(400, "bad_request", f"the request cannot be run: {result.error}")
        if result.finish_reason in ("cancelled", "timeout"):
            raise ApiError(503, "request_ended", f"the request ended early: {result.finish_reason}")
        text = parser.engine.preprocessor.decode(result.token_ids, skip_special_tokens=body.skip_special_tokens)
        text = _before_stop(text, body.stop_strings)
        model = service.info["model"]
        if not body.stream:
            return JSONResponse(completion_body(result, text, model))
        events = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in stream_chunks(result, text, model))
        return StreamingResponse(iter([events + "data: [DONE]\n\n"]), media_type="text/event-stream")


def _before_stop(text: str, stop: tuple[str, ...]) -> str:
    """``text`` up to the first of the ``stop`` strings (all of it when none occurs)."""
    return text[: min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))]


async def _wait_or_cancel(request: Request, handle: RequestHandle) -> GenerationResult:
    """Wait for the engine without blocking the event loop; cancel the engine request if the
    client goes away or this task is cancelled (the engine answers every request, so the wait ends)."""
    future = asyncio.wrap_future(handle.future)
    try:
        while True:
            done, _ = await asyncio.wait({future}, timeout=1.0)
            if done:
                return future.result()
            if await request.is_disconnected():
                handle.cancel()
    except asyncio.CancelledError:
        handle.cancel()
        raise

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

How requests are admitted, queued and shared between identical re-sends is ``chat_admission``'s;
how a streamed answer's text is cut as tokens come is ``chat_text``'s (the fast engine reports
tokens as they come; an engine that does not, the reference one, streams its answer in one piece).
``ChatReplay`` answers recorded outputs (``serve --chat-replay``; tests and benchmarks).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import hashlib
import json
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from mineru_fast.engine.base import GenerationRequest, GenerationResult, RequestHandle
from mineru_fast.errors import InputError
from mineru_fast.inputs.documents import RGB_BYTES_PER_PIXEL, open_document
from mineru_fast.protocol.spec import FLOAT32_MAX, SYSTEM_PROMPT, SamplingParams
from mineru_fast.serve.chat_admission import ChatAdmission, ChatGeneration
from mineru_fast.serve.chat_text import IncrementalText, StopCutter, before_stop
from mineru_fast.serve.errors import ApiError, error_body
from mineru_fast.serve.jobs import CostBudget

if TYPE_CHECKING:
    from mineru_fast.engine.preprocess import Preprocessor
    from mineru_fast.pipeline.parser import DocumentParser
    from mineru_fast.serve.service import Service

__all__ = [
    "ChatRequest",
    "ChatPlan",
    "ChatImageDecoder",
    "ChatReplay",
    "plan_request",
    "prompt_tokens",
    "check_prompt_length",
    "to_generation_request",
    "completion_body",
    "chunk_body",
    "usage_chunk",
    "models_body",
    "add_chat_routes",
]

# The model's input per image pixel: float32 patch values of 3 channels x 2 frames
# (preprocess.EncodedRequest.pixel_values: 3 * 2 * 14 * 14 floats per 14x14-pixel patch).
ENGINE_BYTES_PER_PIXEL = 3 * 2 * 4


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
# ``priority`` from 0, the parse jobs' own (lower goes first: no request is put before them and before
# every other key's requests), to int32's largest (MinerU's client sends a page's index).
MAX_PRIORITY = 2**31 - 1


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
    stream_options: dict[str, Any] | None = None
    n: int = Field(default=1, ge=1, le=1)
    priority: int = Field(default=0, ge=0, le=MAX_PRIORITY)
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
    """Holds a chat request's image memory in the service's decode budget (the one the jobs use).

    ``reserve`` reads the image's header only, nothing decoded, and takes its cost from the budget:
    the peak bytes of decoding it (``OpenedDocument.page_cost``) plus, when ``model_max_pixels`` is
    given, the model's input for it (``ENGINE_BYTES_PER_PIXEL`` per pixel, at most
    ``model_max_pixels`` pixels). ``decode`` then decodes it and gives back the decode's extra above
    the rendered RGB image; what stays taken is held until ``release`` (called when the request has
    ended, whatever the outcome). Calling the decoder does both at once.

    Args:
        budget: the service's ``CostBudget`` (bytes).
        max_pixels: the largest image accepted (``ParserOptions.max_image_pixels``).
        model_max_pixels: the most pixels the model's image processor keeps
            (``Preprocessor.max_image_tokens`` times the pixels of one token); 0 = not counted.
    """

    def __init__(self, budget: CostBudget, max_pixels: int, model_max_pixels: int = 0) -> None:
        self.budget, self.max_pixels, self.model_max_pixels = budget, max_pixels, model_max_pixels
        self._held = 0
        self._decode_extra = 0
        self._lock = threading.Lock()

    def __call__(self, data: bytes) -> Image.Image:
        """``reserve(data)``, then ``decode(data)``."""
        self.reserve(data)
        return self.decode(data)

    def reserve(self, data: bytes) -> tuple[int, int]:
        """Take the image's cost from the budget (headers read, nothing decoded).

        Returns:
            ``(width, height)`` in pixels of the image ``decode`` will return.

        Raises:
            ApiError: 400 ``bad_image`` for a PDF or more than one frame, 413 ``image_too_large`` when it
                alone needs more than the budget, 429 ``over_capacity`` (``Retry-After``) when the
                budget is in use; 422 ``bad_image`` for an unreadable image.
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
                width, height = opened.page_size(0)
                scale = min(1.0, opened.max_side / max(width, height))  # as ``render`` caps the long side
        except InputError as exc:
            raise ApiError(422, "bad_image", f"the image cannot be used: {exc}") from exc
        model_input = ENGINE_BYTES_PER_PIXEL * min(kept // RGB_BYTES_PER_PIXEL, self.model_max_pixels)
        self._take(peak + model_input)
        self._decode_extra = peak - kept
        return max(1, round(width * scale)), max(1, round(height * scale))

    def decode(self, data: bytes) -> Image.Image:
        """The RGB image in ``data`` (long side at most ``inputs.DEFAULT_MAX_SIDE``), once reserved.

        Raises:
            ApiError: 422 ``bad_image`` for an undecodable image.
        """
        try:
            with open_document(data, max_pixels=self.max_pixels, decode_first=False) as opened:
                return opened.render(0)
        except InputError as exc:
            raise ApiError(422, "bad_image", f"the image cannot be used: {exc}") from exc
        finally:
            extra, self._decode_extra = self._decode_extra, 0
            self._give_back(extra)

    def _take(self, cost: int) -> None:
        limit = self.budget.limit
        if limit is not None and cost > limit:
            raise ApiError(
                413,
                "image_too_large",
                f"the image needs {cost / 2**20:,.0f} MiB (decoded, and the model's input); "
                f"this server's budget is {limit / 2**20:,.0f} MiB",
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


def _image_data(url: str) -> bytes:
    """The bytes of a ``data:image/...;base64,`` URL.

    Raises:
        ApiError: 400 for another URL scheme or bad base64.
    """
    if not url.startswith("data:") or ";base64," not in url[:100]:
        raise ApiError(
            400, "unsupported_image_url", "image_url must be a base64 data: URL (remote URLs are not fetched)"
        )
    try:
        return base64.b64decode(url.split(";base64,", 1)[1], validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, "bad_image_url", "image_url holds invalid base64") from None


@dataclass(frozen=True)
class ChatPlan:
    """A checked chat request, its image not decoded yet.

    Attributes:
        image_data: the image file's bytes (from the data URL).
        prompt / system / text_before_image / sampling / priority / stop: as in ``GenerationRequest``.
        forced_text: the replayed answer (``ChatReplay``), or None to decode.
    """

    image_data: bytes
    prompt: str
    system: str
    text_before_image: bool
    sampling: SamplingParams
    priority: int = 0
    stop: tuple[str, ...] = ()
    forced_text: str | None = None

    @property
    def image_sha256(self) -> str:
        """Hex SHA-256 of ``image_data``."""
        return hashlib.sha256(self.image_data).hexdigest()

    @property
    def key(self) -> str:
        """The twin key: a digest of everything that decides the generated tokens (the image
        bytes, the prompts and their order, the decoding rules and bounds, the stop strings, a
        replayed answer); requests of equal keys get equal tokens. ``priority`` is left out."""
        fields = {
            "image": self.image_sha256,
            "prompt": self.prompt,
            "system": self.system,
            "text_before_image": self.text_before_image,
            "sampling": dataclasses.asdict(self.sampling),
            "stop": self.stop,
            "forced_text": self.forced_text,
        }
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()

    def request(self, image: Image.Image, speculative: int = 0) -> GenerationRequest:
        """The engine request, with the decoded ``image`` and the server's ``speculative`` bound
        (``ParserOptions.speculative``: drafts change the decode steps, never the answer)."""
        return GenerationRequest(
            image=image,
            prompt=self.prompt,
            sampling=self.sampling,
            forced_text=self.forced_text,
            system=self.system,
            text_before_image=self.text_before_image,
            priority=self.priority,
            stop=self.stop,
            speculative=speculative,
        )


def plan_request(body: ChatRequest, max_new_tokens: int) -> ChatPlan:
    """Check a chat request and take its image's bytes out of the data URL (nothing decoded).

    Args:
        body: the validated request.
        max_new_tokens: the server's bound on generated tokens; used when the request sets none,
            and a larger request is refused.

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
    return ChatPlan(
        image_data=_image_data(url),
        prompt="".join(text_parts),
        sampling=sampling,
        system=system or SYSTEM_PROMPT,
        text_before_image=any(p.type == "text" for p in parts[: images[0]]),
        priority=body.priority,
        stop=body.stop_strings,
    )


_TEMPLATE_ONLY = Image.new("RGB", (1, 1))  # the image of a request whose template alone is read


def prompt_tokens(plan: ChatPlan, preprocessor: Preprocessor, size: tuple[int, int]) -> int:
    """The prompt's length in tokens as the engine encodes it (``Preprocessor.encode``), the image
    not decoded: the chat template's text, control tokens typed in it counted as characters, and
    the image tokens of a ``size`` (width, height in pixels) image.

    Raises:
        ApiError: 400 ``bad_image`` when the image processor refuses that size (its edge ratio).
    """
    try:
        return preprocessor.prompt_length(plan.request(_TEMPLATE_ONLY), size)
    except ValueError as exc:
        raise ApiError(400, "bad_image", f"the image cannot be used: {exc}") from None


def check_prompt_length(plan: ChatPlan, preprocessor: Preprocessor, size: tuple[int, int], max_seq_len: int) -> None:
    """Refuse a request whose prompt (``prompt_tokens``, the image ``size`` pixels) and
    ``max_tokens`` together are more than ``max_seq_len``, the tokens one engine sequence holds.
    The engine refuses it too, but only once it has waited for a place (past ``chat_keepalive``,
    in the body of a ``200``).

    Raises:
        ApiError: 400 ``context_length_exceeded`` (OpenAI's code); as ``prompt_tokens``.
    """
    prompt, bound = prompt_tokens(plan, preprocessor, size), plan.sampling.max_new_tokens
    if prompt + bound > max_seq_len:
        raise ApiError(
            400,
            "context_length_exceeded",
            f"the prompt has {prompt} tokens (the image's included) and max_tokens is {bound}: more than "
            f"the {max_seq_len} tokens this server holds per request; send a shorter prompt or max_tokens",
        )


def to_generation_request(body: ChatRequest, max_new_tokens: int, decode: ChatImageDecoder) -> GenerationRequest:
    """The engine request of a chat request: ``plan_request``, then its image decoded (last, once
    the rest is checked) within the service's budget by ``decode``.

    Raises:
        ApiError: as ``plan_request``; as ``ChatImageDecoder`` for the image.
    """
    plan = plan_request(body, max_new_tokens)
    return plan.request(decode(plan.image_data))


class ChatReplay:
    """Recorded answers a chat server replays (``serve --chat-replay FILE``; tests and benchmarks).

    The file is JSON: ``{"answers": [{"image_sha256": HEX, "prompt": TEXT, "output": TEXT}, ...]}``;
    a request whose image bytes (SHA-256 of the data URL's bytes) and prompt text match an entry is
    decoded with that output forced (``GenerationRequest.forced_text``: every forward pass runs, so
    it costs what decoding it costs), whatever the model would have chosen.

    Raises:
        ValueError: the file is not of that shape (at construction).
    """

    def __init__(self, path: Path) -> None:
        raw = json.loads(path.read_text(encoding="utf-8"))
        answers = raw.get("answers") if isinstance(raw, dict) else None
        if not isinstance(answers, list):
            raise ValueError(f"{path}: a chat replay file holds {{'answers': [...]}}")
        self.answers: dict[tuple[str, str], str] = {}
        for n, entry in enumerate(answers):
            fields = [entry.get(k) if isinstance(entry, dict) else None for k in ("image_sha256", "prompt", "output")]
            image, prompt, output = (v if isinstance(v, str) else None for v in fields)
            if image is None or prompt is None or output is None:
                raise ValueError(f"{path}: answers[{n}] needs the strings image_sha256, prompt and output")
            self.answers[(image, prompt)] = output

    def forced(self, plan: ChatPlan) -> ChatPlan:
        """``plan`` with its recorded answer forced.

        Raises:
            ApiError: 422 ``replay_miss``: no answer was recorded for this image and prompt.
        """
        output = self.answers.get((plan.image_sha256, plan.prompt))
        if output is None:
            raise ApiError(422, "replay_miss", "no recorded answer for this image and prompt (--chat-replay)")
        return dataclasses.replace(plan, forced_text=output)


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


def chunk_body(chunk_id: str, model: str, delta: dict | None, finish_reason: str | None = None) -> dict:
    """One ``chat.completion.chunk`` event of a streamed answer: a ``delta`` (``{"role": ...}``,
    ``{"content": ...}``) or, with ``delta=None``, the finish chunk (an empty delta and ``finish_reason``)."""
    choice = {"index": 0, "delta": delta if delta is not None else {}, "finish_reason": finish_reason}
    return {"id": chunk_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [choice]}  # fmt: skip


def usage_chunk(chunk_id: str, model: str, result: GenerationResult) -> dict:
    """The last chunk when ``stream_options.include_usage`` is set (OpenAI's: no choices, the usage)."""
    usage = completion_body(result, "", model)["usage"]
    return {"id": chunk_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [], "usage": usage}  # fmt: skip


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


class _Answer(StreamingResponse):
    """A streamed answer that runs ``on_close`` once it is over, however it ends (sent, client gone,
    cancelled, never started)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], media_type: str) -> None:
        super().__init__(content, media_type=media_type, headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _Waiter:
    """One chat request waiting for its generation: leaves it and is counted out exactly once.

    ``status`` is what it is counted out with (499, client gone, until an answer is decided)."""

    def __init__(self, admission: ChatAdmission, generation: ChatGeneration) -> None:
        self.admission, self.generation = admission, generation
        self.status = 499
        self.waker: asyncio.Event | None = None
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.waker is not None:
            self.generation.wakers.discard(self.waker)
        self.admission.leave(self.generation)
        self.admission.exit(self.status)


def _result_of(generation: ChatGeneration) -> GenerationResult:
    """The ended generation's result, if it is an answer.

    Raises:
        ApiError: the generation's error; 400 ``bad_request`` when the engine refused the request,
            503 ``request_ended`` when it was cancelled or timed out.
    """
    if generation.error is not None:
        raise generation.error
    result = generation.result
    assert result is not None
    if result.finish_reason == "error":
        raise ApiError(400, "bad_request", f"the request cannot be run: {result.error}")
    if result.finish_reason in ("cancelled", "timeout"):
        raise ApiError(503, "request_ended", f"the request ended early: {result.finish_reason}")
    return result


def _error_in_body(exc: ApiError, request_id: str | None) -> dict:
    """An error told after a ``200`` was sent (vLLM's marker ``"object": "error"``, which MinerU's
    client checks, with the service's error object and the status it would have had)."""
    return {"object": "error", **error_body(exc.code, exc.message, request_id), "status": exc.status}


def add_chat_routes(app: FastAPI, service: Service) -> None:
    """``POST /v1/chat/completions`` and ``GET /v1/models`` on the service's shared engine.

    Requests skip the job queue (as on a vLLM server): each generation is one engine request,
    batched with the parse jobs' requests, admitted by ``ChatAdmission`` (the decode budget bounds
    the queue: ``429`` only when it is full; at most ``max_chat_requests`` requests in flight,
    orphaned generations included; twins of one API key share a generation; twice the engine's
    slots in the engine at once). A prompt that does not fit the engine's sequence length with its
    ``max_tokens`` is refused ``400 context_length_exceeded`` before it is queued. An answer not
    ready within ``chat_keepalive`` seconds is sent as a stream: ``200`` and its headers at once, a
    space (JSON allows leading whitespace) every ``chat_keepalive`` seconds, then the JSON body, so
    a client's read timeout (MinerU's ``http_timeout``) counts from the last byte, not from the
    request; an error after that is the body ``{"object": "error", "error": {...}, "status": N}``.
    ``stream`` answers are server-sent events as tokens come (``: keepalive`` comments while
    queued). A client that disconnects, or a handler cancelled, leaves its generation
    (``ChatAdmission.leave``).
    Keys, limits, metrics and errors are the service's.
    """
    config = service.config
    admission = app.state.chat_admission = ChatAdmission(
        places=2 * config.options.slots,
        max_requests=config.max_chat_requests,
        orphan_grace=config.chat_orphan_grace,
        registry=service.metrics.registry,
    )
    replay = ChatReplay(config.chat_replay) if config.chat_replay is not None else None
    decoding = asyncio.Semaphore(config.workers)  # images decoded at once (CPU), each within the budget

    def planned(body: ChatRequest, bound: int, owner: str | None) -> tuple[ChatPlan, str]:
        plan = plan_request(body, bound)
        plan = replay.forced(plan) if replay is not None else plan
        return plan, f"{owner or ''}:{plan.key}"  # twins within one API key (a key's name has no ':')

    async def admit(body: ChatRequest, parser: DocumentParser, owner: str | None) -> ChatGeneration:
        """The generation this request of API key ``owner`` waits for: a twin's, or a new one
        admitted in the budget once its prompt is known to fit the engine."""
        options = parser.options
        bound = max(options.sampling(task).max_new_tokens for task in ("layout", "text", "table", "equation"))
        plan, key = await run_in_threadpool(planned, body, bound, owner)
        generation = admission.join(key)
        if generation is not None:
            return generation
        pre = parser.engine.preprocessor
        model_pixels = pre.image_processor.max_pixels
        decoder = ChatImageDecoder(service.require_ready().budget, options.max_image_pixels, model_pixels)
        max_seq_len = getattr(parser.engine, "max_seq_len", None)  # the fast engine's; the reference one has none

        def reserve() -> None:
            size = decoder.reserve(plan.image_data)
            if max_seq_len is not None:
                try:
                    check_prompt_length(plan, pre, size, max_seq_len)
                except ApiError:
                    decoder.release()
                    raise

        await run_in_threadpool(reserve)
        generation = admission.join(key)  # a twin may have started while the header was read
        if generation is not None:
            decoder.release()
            return generation

        async def run(generation: ChatGeneration) -> RequestHandle | None:
            async with decoding:
                if generation.cancelled:
                    return None
                image = await run_in_threadpool(decoder.decode, plan.image_data)
            if generation.cancelled:
                return None
            return await run_in_threadpool(parser.engine.submit, plan.request(image, options.speculative))

        return admission.start(key, plan.priority, decoder.release, run)

    @app.get("/v1/models")
    async def models() -> dict:
        """The served model (MinerU's clients read its id)."""
        service.require_ready()
        return models_body(service.info["model"])

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request, body: ChatRequest) -> Response:
        """One image + prompt decoded greedily by the shared engine (OpenAI chat format)."""
        parser = service.require_parser()
        admission.enter()
        try:
            generation = await admit(body, parser, request.state.api_key)
        except ApiError as exc:
            admission.exit(exc.status)
            raise
        except BaseException:
            admission.exit(500)
            raise
        waiter = _Waiter(admission, generation)  # from here every path closes it once

        def text_of(result: GenerationResult) -> str:
            text = parser.engine.preprocessor.decode(result.token_ids, skip_special_tokens=body.skip_special_tokens)
            return before_stop(text, body.stop_strings)

        if body.stream:
            waiter.waker = asyncio.Event()
            generation.wakers.add(waiter.waker)
            events = _sse_events(waiter, body, parser, service.info["model"], config.chat_keepalive, request)
            return _Answer(events, waiter.close, "text/event-stream")
        handed_over = False  # to an _Answer, which closes the waiter
        try:
            await _wait(generation, request, config.chat_keepalive)
            if not generation.done.is_set():
                early = _keepalive_json(waiter, text_of, service.info["model"], config.chat_keepalive, request)
                handed_over = True
                return _Answer(early, waiter.close, "application/json")
            try:
                result = _result_of(generation)
            except ApiError as exc:
                waiter.status = exc.status
                raise
            waiter.status = 200
            return JSONResponse(completion_body(result, text_of(result), service.info["model"]))
        finally:
            if not handed_over:
                waiter.close()


async def _wait(generation: ChatGeneration, request: Request, seconds: float) -> None:
    """Wait up to ``seconds`` for ``generation`` to end, watching the client.

    Raises:
        ApiError: 499 ``client_gone`` when the client disconnected meanwhile.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not generation.done.is_set() and (left := deadline - loop.time()) > 0:
        try:
            await asyncio.wait_for(generation.done.wait(), min(1.0, left))
        except TimeoutError:
            if await request.is_disconnected():
                raise ApiError(499, "client_gone", "the client disconnected") from None


async def _keepalive_json(
    waiter: _Waiter, text_of: Callable[[GenerationResult], str], model: str, keepalive: float, request: Request
) -> AsyncIterator[bytes]:
    """A ``200`` JSON answer sent early: a space every ``keepalive`` seconds until the generation
    ends, then the completion (or the error, in the body)."""
    generation = waiter.generation
    while not generation.done.is_set():
        try:
            await asyncio.wait_for(generation.done.wait(), keepalive)
        except TimeoutError:
            yield b" "
    try:
        result = _result_of(generation)
    except ApiError as exc:
        waiter.status = exc.status
        yield json.dumps(_error_in_body(exc, request.state.request_id)).encode()
        return
    waiter.status = 200
    yield json.dumps(completion_body(result, text_of(result), model)).encode()


def _sse(payload: dict | str) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


async def _sse_events(
    waiter: _Waiter, body: ChatRequest, parser: DocumentParser, model: str, keepalive: float, request: Request
) -> AsyncIterator[bytes]:
    """The server-sent events of a streamed answer: the role, the text as tokens come (held back
    where it could begin a stop string), the finish reason, the usage when asked, ``[DONE]``; a
    ``: keepalive`` comment every ``keepalive`` seconds without news."""
    generation, waker = waiter.generation, waiter.waker
    assert waker is not None
    chunk_id = f"chatcmpl-{secrets.token_hex(12)}"
    decode = parser.engine.preprocessor.decode
    texts = IncrementalText(lambda ids: decode(ids, skip_special_tokens=body.skip_special_tokens))
    cutter = StopCutter(body.stop_strings)
    yield _sse(chunk_body(chunk_id, model, {"role": "assistant", "content": ""}))
    while not generation.done.is_set():
        try:
            await asyncio.wait_for(waker.wait(), keepalive)
        except TimeoutError:
            yield b": keepalive\n\n"
            continue
        waker.clear()
        if generation.handle is not None and not generation.done.is_set():
            delta = cutter.add(texts.feed(generation.handle.tokens()))
            if delta:
                yield _sse(chunk_body(chunk_id, model, {"content": delta}))
    try:
        result = _result_of(generation)
    except ApiError as exc:
        waiter.status = exc.status
        yield _sse(_error_in_body(exc, request.state.request_id))
        yield _sse("[DONE]")
        return
    rest = cutter.finish(decode(result.token_ids, skip_special_tokens=body.skip_special_tokens))
    if rest:
        yield _sse(chunk_body(chunk_id, model, {"content": rest}))
    yield _sse(chunk_body(chunk_id, model, None, _finish_reason(result)))
    if (body.stream_options or {}).get("include_usage"):
        yield _sse(usage_chunk(chunk_id, model, result))
    waiter.status = 200
    yield _sse("[DONE]")

"""The service's start-up checks: the engine check that readiness waits for, and the canary page.

The engine check (``run_engine_check``) sends one small image (``engine_check_image``: 16 image
tokens) with a forced output through the engine every request takes: vision encoder, prefill and
a few decode steps, the tokens replayed (``GenerationRequest.forced_text``) so that random weights
pass as trained ones do. It proves that the engine answers and computes finite numbers without the
1036x1036 layout pass, so a service is ready seconds after its model is loaded.

The canary page (``parsing.run_canary``) checks the whole pipeline (layout pass, crops, protocol,
post-processing) on a replayed page: about a minute for the full-size model on 2 cores, most of it
the layout pass. ``Canary`` runs it and keeps its state for ``/ready``; the service runs it before
it becomes ready, after, or not at all (``ServeConfig.canary``).
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
import time
from typing import Literal

from PIL import Image, ImageDraw

from mineru_fast.engine.base import GenerationRequest
from mineru_fast.engine.interface import Engine
from mineru_fast.pipeline.parser import DocumentParser
from mineru_fast.protocol.spec import SamplingParams, prompt_for
from mineru_fast.serve.config import CanaryMode
from mineru_fast.serve.parsing import run_canary

__all__ = [
    "CanaryState",
    "Canary",
    "EngineCheckFailed",
    "engine_check_image",
    "run_engine_check",
]

CanaryState = Literal["pending", "running", "passed", "failed", "off"]

ENGINE_CHECK_TEXT = "mineru-fast engine check"  # the output forced: a few tokens of plain text
ENGINE_CHECK_SIDE = 112  # pixels: a 4x4 grid of merged 28-pixel windows, 16 image tokens
ENGINE_CHECK_TIMEOUT = 300.0  # seconds: a bound on a hung engine, not a wait (the check takes seconds)


class EngineCheckFailed(RuntimeError):
    """The engine check's request failed, timed out or came back other than asked."""


def engine_check_image() -> Image.Image:
    """The engine check's image: ``ENGINE_CHECK_SIDE`` pixels square, white with a black bar and
    square (16 image tokens after the 2x2 merge; MinerU2.5's smallest image is 56x56)."""
    image = Image.new("RGB", (ENGINE_CHECK_SIDE, ENGINE_CHECK_SIDE), "white")
    draw = ImageDraw.Draw(image)
    draw.rectangle((12, 20, 100, 32), fill="black")
    draw.rectangle((12, 60, 40, 88), fill="black")
    return image


def run_engine_check(engine: Engine, timeout: float = ENGINE_CHECK_TIMEOUT) -> dict:
    """Send ``engine_check_image()`` with the text task's prompt through ``engine``, its output
    forced to ``ENGINE_CHECK_TEXT``, and check what comes back.

    Every forward pass runs in full (vision encoder, prefill, one decode step per token); the
    forced tokens are chosen instead of the model's, so the outcome does not depend on the weights.

    Args:
        engine: the engine every request of the service goes through.
        timeout: seconds to wait for the result; then the request is cancelled.

    Returns:
        ``{"seconds", "image_tokens", "prompt_tokens", "tokens"}``: wall time, image tokens and
        prompt tokens (image included) of the request, tokens generated (end token included).

    Raises:
        EngineCheckFailed: the request failed or timed out, ended otherwise than with its end
            token, came back with other tokens than those forced, or with a log-probability that
            is not finite (the model computes NaN or infinity).
    """
    preprocessor = engine.preprocessor
    image = engine_check_image()
    window = preprocessor.image_processor.patch_size * preprocessor.merge_size
    width, height = preprocessor.image_processor.target_size(*image.size)
    expected = preprocessor.forced_ids(ENGINE_CHECK_TEXT)
    # room for the end token and a few more: a forced sequence stops at its end token
    sampling = SamplingParams(max_new_tokens=len(expected) + 4)
    request = GenerationRequest(image, prompt_for("text"), sampling, forced_text=ENGINE_CHECK_TEXT)
    start = time.perf_counter()
    handle = engine.submit(request)
    try:
        result = handle.result(timeout)
    except (TimeoutError, concurrent.futures.TimeoutError):
        handle.cancel()
        raise EngineCheckFailed(f"engine check failed: no answer in {timeout:g} s") from None
    seconds = time.perf_counter() - start
    if result.finish_reason == "error":
        raise EngineCheckFailed(f"engine check failed: the request failed: {result.error}")
    if result.finish_reason != "stop":
        raise EngineCheckFailed(f"engine check failed: the request ended with {result.finish_reason!r}, not its end")
    if result.token_ids != expected:
        raise EngineCheckFailed(
            f"engine check failed: {len(result.token_ids)} tokens came back, not the {len(expected)} forced"
            if len(result.token_ids) != len(expected)
            else "engine check failed: other tokens came back than those forced"
        )
    logprobs = result.logprobs or []
    if len(logprobs) != len(expected) or not all(math.isfinite(p) for p in logprobs):
        raise EngineCheckFailed("engine check failed: a log-probability is not finite (the model computes NaN or inf)")
    return {
        "seconds": round(seconds, 3),
        "image_tokens": width * height // window**2,
        "prompt_tokens": result.prompt_tokens,
        "tokens": len(result.token_ids),
    }


class Canary:
    """The canary page of one service: when it runs (``mode``), and its state for ``/ready``.

    States: ``"off"`` (mode ``off``), ``"pending"`` (not started), ``"running"``, ``"passed"``,
    ``"failed"``. Thread-safe: ``run`` goes on in one thread while ``describe`` is read in others.

    Args:
        mode: ``"after-ready"``, ``"before-ready"`` or ``"off"`` (``ServeConfig.canary``).
    """

    def __init__(self, mode: CanaryMode) -> None:
        self.mode: CanaryMode = mode
        self.state: CanaryState = "off" if mode == "off" else "pending"
        self.seconds: float | None = None
        self.blocks: int | None = None
        self._lock = threading.Lock()

    def run(self, parser: DocumentParser) -> dict:
        """Parse the canary page with ``parser`` (``parsing.run_canary``), recording the state.

        Returns:
            ``run_canary``'s ``{"status", "seconds", "blocks"}``.

        Raises:
            Exception: whatever ``run_canary`` raised (the state is then ``"failed"``, with the
                seconds it ran).
        """
        with self._lock:
            self.state = "running"
        start = time.perf_counter()
        try:
            outcome = run_canary(parser)
        except Exception:
            with self._lock:
                self.state, self.seconds = "failed", round(time.perf_counter() - start, 3)
            raise
        with self._lock:
            self.state, self.seconds, self.blocks = "passed", outcome["seconds"], outcome["blocks"]
        return outcome

    def describe(self) -> dict:
        """``{"mode", "state"}``, with ``"seconds"`` once it passed or failed and ``"blocks"`` (of
        the parsed page) once it passed."""
        with self._lock:
            described: dict = {"mode": self.mode, "state": self.state}
            if self.seconds is not None:
                described["seconds"] = self.seconds
            if self.blocks is not None:
                described["blocks"] = self.blocks
            return described

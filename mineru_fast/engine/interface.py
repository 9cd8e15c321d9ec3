"""The interface every engine implements: the reference engine (``reference``), the fast engine
(``generate``) and the fast engine with IPEX's vision runner are all an ``Engine``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from mineru_fast.engine.base import FollowUp, GenerationRequest, GenerationResult, RequestHandle
from mineru_fast.engine.preprocess import Preprocessor

__all__ = ["Engine"]


class Engine(Protocol):
    """An inference engine: one loop, requests from any thread. ``submit`` never raises for one bad
    request: that request's result has ``finish_reason == "error"`` and the others are unaffected.

    Attributes:
        preprocessor: the checkpoint's tokenizer and image processor (``preprocess.Preprocessor``).
    """

    preprocessor: Preprocessor

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue ``request``; the handle resolves when it is finished."""
        ...

    def generate(
        self, requests: Sequence[GenerationRequest], on_result: FollowUp | None = None
    ) -> list[GenerationResult]:
        """Decode every request and every follow-up ``on_result`` returns; results in index order."""
        ...

    def close(self) -> None:
        """Stop the loop: requests still queued or running end with ``finish_reason="cancelled"``."""
        ...

"""What every engine takes and returns: requests in, token sequences out."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from PIL import Image

from ..protocol import SamplingParams

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # ParserOptions.precision -> torch dtype

FinishReason = Literal["stop", "length", "repetition", "error"]


@dataclass(frozen=True)
class GenerationRequest:
    """One image + task prompt to decode.

    Attributes:
        image: RGB input image (the 1036x1036 layout image or a block crop).
        prompt: task prompt, e.g. ``"\\nLayout Detection:"`` (see ``protocol.PROMPTS``).
        sampling: decoding rules (greedy; penalties; bounds).
        forced_text: replay: the exact output to produce. The engine then chooses these tokens
            (followed by ``<|im_end|>``) instead of its argmax, while computing every forward pass
            and logits step in full, so time and memory equal the real model producing it.
    """

    image: Image.Image
    prompt: str
    sampling: SamplingParams
    forced_text: str | None = None


@dataclass
class GenerationResult:
    """Output of one request.

    Attributes:
        text: decoded output, special tokens kept, end token removed.
        token_ids: generated token ids, end token included when generated.
        finish_reason: ``"stop"`` (end token), ``"length"`` (max_new_tokens or KV buffer reached),
            ``"repetition"`` (ended by the repetition guard) or ``"error"``.
        prompt_tokens: prompt length in tokens, image tokens included.
        vision_s / prefill_s / decode_s: seconds in the vision encoder, in the rest of the
            prefill, and in decode steps (logits processing included).
        error: the message when ``finish_reason == "error"``.
    """

    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int = 0
    vision_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    error: str | None = None


FollowUp = Callable[[int, GenerationResult], Sequence[GenerationRequest]]
"""``on_result(index, result) -> follow-up requests``: called as each request finishes (errors
included); the requests it returns are run in the same ``generate`` call and take the next free
indices, in the order returned."""


class Engine(Protocol):
    """An inference engine. ``generate`` never raises for one bad request: that request's result
    has ``finish_reason == "error"`` and the others are unaffected."""

    def generate(
        self, requests: Sequence[GenerationRequest], on_result: FollowUp | None = None
    ) -> list[GenerationResult]:
        """Decode every request and every follow-up ``on_result`` returns; results in index order."""
        ...

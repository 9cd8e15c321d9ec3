"""Requests -> model inputs, and generated ids -> text: shared by every engine.

Images go through Qwen2-VL's preprocessing with the checkpoint's settings
(``engine.image_processor``: smart resize to multiples of 28 px, CLIP normalization, 14 px patches
in 2x2 merge-window order, each image repeated to 2 frames) and prompts through the checkpoint's
tokenizer (``tokenizer.json`` read by the ``tokenizers`` library), so all engines see identical
inputs. transformers is not imported here: its tokenizer and image-processor modules cost about
3 s and 150 MB at every start-up, and give the same ids and pixels (``tests/test_preprocess.py``).
The single ``<|image_pad|>`` of the prompt is expanded to ``t * h * w / merge_size**2`` copies, as
Qwen2-VL's processor does.

Text is text: the template's control tokens are inserted as ids, and the text between them (the
system prompt, the user's text) is tokenized with special tokens treated as plain text (vLLM's and
llama.cpp's default for chat content), so ``<|image_pad|>`` or ``<|im_start|>`` typed by a caller are
characters, never an image pad or a forged turn. The tokenizer splits a text at its special tokens
and tokenizes the pieces independently, so text without special tokens gets the ids of the rendered
template (``chat_prompt``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mineru_fast.engine.base import GenerationRequest
from mineru_fast.engine.image_processor import ImageProcessor
from mineru_fast.errors import ModelLoadError
from mineru_fast.protocol.spec import END_TOKENS, IMAGE_PLACEHOLDER, SYSTEM_PROMPT

if TYPE_CHECKING:
    from tokenizers import Tokenizer

CONTROL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")  # of chat_prompt


def chat_prompt(request: GenerationRequest) -> str:
    """The chat text of one request: a system turn, a user turn with one image placeholder and the
    request's text (image first unless ``text_before_image``), and the assistant's opening.

    Equal to Qwen2-VL's chat template (``protocol.CHAT_TEMPLATE``) rendered with
    ``add_generation_prompt``; an empty or missing system prompt renders the template's default.
    """
    parts = (request.prompt, IMAGE_PLACEHOLDER) if request.text_before_image else (IMAGE_PLACEHOLDER, request.prompt)
    user = "".join(parts)
    return (
        f"<|im_start|>system\n{request.system or SYSTEM_PROMPT}<|im_end|>\n"
        f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    )


@dataclass
class EncodedRequest:
    """Model inputs of one request.

    Attributes:
        input_ids: ``[L]`` int64 prompt ids, image pads expanded.
        pixel_values: ``[patches, 3*2*14*14]`` float32.
        grid_thw: ``(t, h, w)`` patch grid of the image.
        forced: token ids replay must produce (end token included), or None.
    """

    input_ids: torch.Tensor
    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    forced: list[int] | None


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The checkpoint's tokenizer (``tokenizer.json``, as MinerU2.5's hub repositories ship it) as a
    ``tokenizers.Tokenizer``.

    Raises:
        ModelLoadError: the file is missing or malformed; the message says how to write it from
            ``vocab.json`` / ``merges.txt`` with transformers.
    """
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(
            f"{model_dir} has no tokenizer.json; write it once with transformers: "
            f"AutoTokenizer.from_pretrained(dir).save_pretrained(dir)"
        )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
        raise ModelLoadError(f"cannot load the tokenizer {path}: {exc}") from exc


class Preprocessor:
    """Tokenizer and image processor of a checkpoint directory.

    Raises:
        ModelLoadError: the directory lacks tokenizer or image processor files, or they are not
            Qwen2-VL's.
    """

    def __init__(self, model_dir: str | Path) -> None:
        self.tokenizer = load_tokenizer(model_dir)
        # Forced outputs are encoded without the tokenizer's normalizer (Qwen2's is NFC): a model's
        # tokens decode to its bytes as they are, so replay must give back a trace's code points
        # as they are too (a letter and a combining accent stay two), not their composed form.
        self._output_tokenizer = load_tokenizer(model_dir)
        self._output_tokenizer.normalizer = None
        self._encode_lock = threading.Lock()
        self.image_processor = ImageProcessor.from_pretrained(model_dir)
        self.end_ids: list[int] = [self._token_id(t, model_dir) for t in END_TOKENS]
        self.image_token_id = self._token_id("<|image_pad|>", model_dir)
        self._control_ids = {t: self._token_id(t, model_dir) for t in CONTROL_TOKENS}
        self.merge_size = self.image_processor.merge_size
        # The image processor resizes every image to at most max_pixels pixels (2048 * 28 * 28 for
        # MinerU2.5), i.e. this many LM tokens after the 2x2 merge.
        window = self.image_processor.patch_size * self.merge_size
        self.max_image_tokens = self.image_processor.max_pixels // window**2

    def _token_id(self, token: str, model_dir: str | Path) -> int:
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise ModelLoadError(f"the tokenizer of {model_dir} has no {token} token")
        return int(token_id)

    def encode(self, request: GenerationRequest, max_prompt_tokens: int | None = None) -> EncodedRequest:
        """Prompt ids and pixels of a request.

        Args:
            max_prompt_tokens: refuse a prompt whose text alone (image tokens not counted) has more
                tokens than this, before the image is processed.

        Raises:
            ValueError: the text is over ``max_prompt_tokens``; the image processor's refusals
                (e.g. an edge ratio above 200).
        """
        pieces = self._template_pieces(request)
        texts = [p for p in pieces if isinstance(p, str)]
        tokenized = iter(self.plain_text_ids(texts))
        text_ids = [p if not isinstance(p, str) else next(tokenized) for p in pieces]
        text_tokens = sum(len(p) for p in text_ids if p is not None)
        if max_prompt_tokens is not None and text_tokens > max_prompt_tokens:
            raise ValueError(f"the prompt's text has {text_tokens} tokens, more than the {max_prompt_tokens} allowed")
        pixel_values, grid = self.image_processor(request.image)
        n_image_tokens = grid[0] * grid[1] * grid[2] // self.merge_size**2
        ids = [t for p in text_ids for t in (p if p is not None else [self.image_token_id] * n_image_tokens)]
        forced = self.forced_ids(request.forced_text) if request.forced_text is not None else None
        return EncodedRequest(torch.tensor(ids, dtype=torch.long), pixel_values, grid, forced)

    def prompt_length(self, request: GenerationRequest, image_size: tuple[int, int]) -> int:
        """The number of prompt ids ``encode`` makes for ``request`` were its image ``image_size``
        (width, height in pixels), without processing any image (``request.image`` is not read).

        Raises:
            ValueError: the image processor refuses that size (e.g. an edge ratio above 200).
        """
        width, height = self.image_processor.target_size(*image_size)
        window = self.image_processor.patch_size * self.merge_size  # the pixels of one image token
        pieces = self._template_pieces(request)
        controls = sum(len(p) for p in pieces if isinstance(p, list))
        texts = self.plain_text_ids([p for p in pieces if isinstance(p, str)])
        return controls + sum(len(ids) for ids in texts) + width * height // window**2

    def _template_pieces(self, request: GenerationRequest) -> list[str | list[int] | None]:
        """``chat_prompt(request)`` as control-token ids (lists), the place of the image pads
        (None) and the text between them (strings, to be tokenized as plain text)."""
        start, end = self._control_ids["<|im_start|>"], self._control_ids["<|im_end|>"]
        image = [[self._control_ids["<|vision_start|>"]], None, [self._control_ids["<|vision_end|>"]]]
        before, after = (request.prompt, "") if request.text_before_image else ("", request.prompt)
        return [
            [start],
            f"system\n{request.system or SYSTEM_PROMPT}",
            [end],
            "\n",
            [start],
            f"user\n{before}",
            *image,
            after,
            [end],
            "\n",
            [start],
            "assistant\n",
        ]

    def plain_text_ids(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text with special tokens as plain characters (transformers'
        ``split_special_tokens=True``); added tokens that are not special (OTSL's) still match.
        The switch is the tokenizer's own state, so it is flipped under ``_encode_lock``."""
        with self._encode_lock:
            self.tokenizer.encode_special_tokens = True
            try:
                return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]
            finally:
                self.tokenizer.encode_special_tokens = False

    def text_ids(self, text: str) -> list[int]:
        """Ids of a model output ``text``, its special tokens (boxes, refs, OTSL) matched as tokens,
        not normalized: ``decode`` gives ``text`` back code point for code point."""
        with self._encode_lock:
            return self._output_tokenizer.encode(text, add_special_tokens=False).ids

    def forced_ids(self, text: str) -> list[int]:
        """Token ids that replay forces for an output ``text``: its encoding, then ``<|im_end|>``."""
        return self.text_ids(text) + [self.end_ids[0]]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """Output text of generated ids, end tokens dropped; special tokens kept unless
        ``skip_special_tokens`` (MinerU's outputs need them: boxes, refs, OTSL)."""
        ids = [t for t in token_ids if t not in self.end_ids]
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def mrope_positions(self, encoded: EncodedRequest) -> torch.Tensor:
        """M-RoPE positions ``[3, L]`` (temporal, height, width) of a prompt with one image.

        Text tokens count up on all three axes; the image's tokens take ``start + (0, row, col)``
        on the merged grid; text after the image resumes at ``start + max(rows, cols)``
        (Qwen2-VL's ``get_rope_index``).
        """
        ids = encoded.input_ids
        is_image = (ids == self.image_token_id).nonzero().flatten()
        if len(is_image) == 0:
            return torch.arange(len(ids)).expand(3, -1).clone()
        start, count = int(is_image[0]), len(is_image)
        t, h, w = encoded.grid_thw
        rows, cols = h // self.merge_size, w // self.merge_size
        before = torch.arange(start).expand(3, -1)
        grid_t = torch.arange(t).repeat_interleave(rows * cols)
        grid_h = torch.arange(rows).repeat_interleave(cols).repeat(t)
        grid_w = torch.arange(cols).repeat(rows * t)
        image = torch.stack([grid_t, grid_h, grid_w]) + start
        resume = start + max(rows, cols)
        after = torch.arange(len(ids) - start - count).expand(3, -1) + resume
        return torch.cat([before, image, after], dim=1)

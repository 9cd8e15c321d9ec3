"""Fidelity of reduced-precision configurations against the float32 engine, step by step.

For one replayed page (its layout request, then one crop request per readable block, every one
with its forced output) each configuration and the float32 engine run the same requests at
batch 1 with teacher forcing: the vision encoder, the prefill of the prompt, then one decode step
per forced token, always feeding the forced token, so every configuration predicts each step from
the same prefix. At every step the two logit vectors (the model's, before the decoding rules) are
compared:

- top-1 agreement: the share of steps where both put the same token first (a greedy decode
  would have continued identically there);
- logits cosine: cosine similarity of the two vectors, averaged over the steps.

It uses only the engine's parts (``preprocessor``, ``vision_runner``, ``lm.prefill``,
``lm.decode``), not its scheduler, and keeps every engine loaded, comparing step by step, so no
logits are stored. The float32 engine is the ``exact`` preset with float32 LM weights: float32
math on the checkpoint's weights (a bfloat16 checkpoint's weights are upcast exactly).

At batch 1 a per-tensor activation scale (``int8_kernel="torch_ao"``) covers one token while
decoding and the whole prompt while prefilling; in a batch it follows the largest value among
all the batch's rows, so its batched numerics can only be worse than measured here.

Real text (``run_content``, spec ``"mode": "content"``): on a checkpoint whose language model is
trained (``hub.lm_source``: a GGUF's weights beside a random vision tower), the content
requests of the workload's pages are teacher-forced with the ground-truth text (text blocks as
text, tables as OTSL, formulas as LaTeX: ``traces.build_omnidocbench_traces``), each crop shrunk
to ``CONTENT_IMAGE`` (8 image tokens, so the random vision's features are a small part of every
prompt). A sequence's forced steps come from one prefill (``forced_logits_prefill``). Reported per
block type and per token class (plain text, or ``SPECIAL_FROM`` and up: Qwen2-VL's special tokens,
the end token, MinerU's own OTSL / layout tokens), over all steps and over the steps where the
float32 engine is confident (its top-1 softmax probability >= ``CONFIDENT_P``): a near-tie flips
under any perturbation and says nothing about a format. Then a few blocks of each type decode
freely (greedy with the protocol's decoding rules, at most ``FREE_TOKENS`` new tokens, batch 1)
through the engine's own loop: the share of outputs identical to the float32 engine's, and the
median number of tokens before the first difference. llama.cpp's Q8_0 of the same checkpoint,
as MinerU 4 runs it on a CPU, can be measured on the same requests (``_llama_cpp_row``: forced
top-1 and free running, through its server's next-token log-probabilities; no cosine).

Configurations run one after another (the float32 engine first; its logits are kept in float16
for the cosine, its top-1 token and probability from the float32 values), so one full-size model
is in memory at a time.

Run one comparison (the benchmark does this in a subprocess):
``python -m mineru_fast.bench.fidelity '<json spec>'`` prints one JSON line.
"""

from __future__ import annotations

import base64
import functools
import io
import json
import os
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mineru_fast.bench.workload import WorkloadPage
from mineru_fast.engine.base import GenerationRequest
from mineru_fast.options import ParserOptions
from mineru_fast.protocol.page import plan_content, read_layout
from mineru_fast.protocol.spec import LAYOUT_TASK, layout_image, prompt_for

FP32 = {"preset": "exact", "overrides": {"lm_quant": "none", "lm_head_quant": "none"}}  # the float32 engine
CONFIDENT_P = 0.5  # a step is confident when the float32 engine's top-1 softmax probability is >= this
SPECIAL_FROM = 151643  # token ids from here are special: Qwen2-VL's (protocol.QWEN2VL_SPECIAL_TOKENS), then MinerU's
# Crops shrunk to this (width, height): 8x4 patches, 8 image tokens, the fewest llama.cpp's Qwen2-VL
# preprocessing keeps unresized (its minimum of 8 tokens, tools/mtmd/clip.cpp), so both engines
# see the same pixels.
CONTENT_IMAGE = (112, 56)
CONTENT_IMAGE_TOKENS = (CONTENT_IMAGE[0] // 28) * (CONTENT_IMAGE[1] // 28)  # a token: 2x2 patches of 14 pixels
FREE_TOKENS = 64  # most new tokens of a free-running block
CONTENT_TASKS = ("text", "table", "equation")
LLAMA_CPP_ROW = "llama.cpp Q8_0 (same weights)"  # MinerU 4's CPU runtime (bench.llamacpp's tools)
LLAMA_CPP_TOP = 20  # log-probabilities llama-server returns per step (its n_probs)

# The precisions and kernels the project offers, against the float32 engine (``run_content``'s default).
# the fast preset's language model before 32-value blocks
PER_CHANNEL = {"lm_quant": "int8-dynamic", "lm_head_quant": "int8-dynamic"}
CONTENT_CONFIGS: dict[str, dict] = {
    "exact preset (bf16-stored weights, fp32 math)": {"preset": "exact", "overrides": {}},
    "bf16 preset": {"preset": "bf16", "overrides": {}},
    "fast preset: INT8 32-value blocks, own kernel (INT8 head)": {"preset": "fast", "overrides": {}},
    "fast, INT8 32-value blocks, float head": {"preset": "fast", "overrides": {"lm_head_quant": "bf16-weights"}},
    "fast, INT8 per channel / per token, oneDNN (INT8 head)": {
        "preset": "fast",
        "overrides": {**PER_CHANNEL, "int8_kernel": "onednn"},
    },
    "fast, INT8 per channel / per token, int_mm (INT8 head)": {
        "preset": "fast",
        "overrides": {**PER_CHANNEL, "int8_kernel": "int_mm"},
    },
    "fast, INT8 per tensor, torch.ao (INT8 head)": {
        "preset": "fast",
        "overrides": {**PER_CHANNEL, "int8_kernel": "torch_ao"},
    },
    "fast, weight-only INT8 LM and head": {
        "preset": "fast",
        "overrides": {"lm_quant": "int8-weight-only", "lm_head_quant": "int8-weight-only"},
    },
}


@dataclass
class Agreement:
    """Running comparison of one configuration with the float32 engine.

    Attributes:
        steps: forced steps compared.
        top1_same: steps whose argmax token equals the float32 engine's.
        cosine_sum: sum over steps of the logits' cosine similarity.
        cosine_min: the lowest step cosine.
        by_task: the same counts per task (``"layout"``, ``"text"``, ...), as
            ``{task: [steps, top1_same, cosine_sum]}``.
    """

    steps: int = 0
    top1_same: int = 0
    cosine_sum: float = 0.0
    cosine_min: float = 1.0
    by_task: dict[str, list] = field(default_factory=dict)

    def add(self, task: str, logits: torch.Tensor, reference: torch.Tensor) -> None:
        """Count one step: ``logits`` and ``reference`` ``[vocab]`` float32."""
        same = int(logits.argmax() == reference.argmax())
        cosine = float(F.cosine_similarity(logits.double(), reference.double(), dim=0))
        self.steps += 1
        self.top1_same += same
        self.cosine_sum += cosine
        self.cosine_min = min(self.cosine_min, cosine)
        counts = self.by_task.setdefault(task, [0, 0, 0.0])
        counts[0], counts[1], counts[2] = counts[0] + 1, counts[1] + same, counts[2] + cosine

    def summary(self) -> dict:
        """``top1_pct`` (0-100), ``mean_cosine``, ``min_cosine``, ``steps`` and per task."""
        return {
            "steps": self.steps,
            "top1_pct": 100 * self.top1_same / max(1, self.steps),
            "mean_cosine": self.cosine_sum / max(1, self.steps),
            "min_cosine": self.cosine_min,
            "by_task": {
                task: {"steps": n, "top1_pct": 100 * same / n, "mean_cosine": total / n}
                for task, (n, same, total) in self.by_task.items()
            },
        }


def page_requests(page: WorkloadPage, options: ParserOptions) -> list[tuple[str, GenerationRequest]]:
    """The page's requests as the parser makes them, as ``(task, request)``: the layout request,
    then one per readable block with a forced output (blocks without one are skipped)."""
    layout = GenerationRequest(
        layout_image(page.image), prompt_for(LAYOUT_TASK), options.sampling(LAYOUT_TASK), page.trace.layout
    )
    out = [(LAYOUT_TASK, layout)]
    page_layout = read_layout(page.trace.layout)
    for request in plan_content(page.image, page_layout, image_analysis=False):
        forced = page.trace.content_for(page_layout.blocks[request.block_index])
        if forced is not None:
            sampling = options.sampling(request.task)
            out.append((request.task, GenerationRequest(request.image, request.prompt, sampling, forced)))
    return out


def _prompt_embeds(engine, request: GenerationRequest):
    """``(encoded, embeds [T, hidden], positions [3, T])`` of ``request``'s prompt: its token
    embeddings with the vision encoder's output at the image pads, and its M-RoPE positions."""
    encoded = engine.preprocessor.encode(request)
    image_embeds = engine.vision_runner(encoded.pixel_values, [encoded.grid_thw])
    embeds = engine.lm.embed_tokens(encoded.input_ids)
    embeds[encoded.input_ids == engine.preprocessor.image_token_id] = image_embeds.to(embeds.dtype)
    return encoded, embeds, engine.preprocessor.mrope_positions(encoded)


@torch.inference_mode()
def forced_logits(engine, request: GenerationRequest) -> Iterator[torch.Tensor]:
    """Logits ``[vocab]`` float32 before each forced token of ``request``, at batch 1 in slot 0:
    the prefill's, then one decode step per forced token but the last."""
    encoded, embeds, positions = _prompt_embeds(engine, request)
    ids = encoded.input_ids
    yield engine.lm.prefill(embeds[None], positions[:, None], 0)[0]
    rope, cache = int(positions.max()) + 1, len(ids)
    for step, token in enumerate(encoded.forced[:-1]):
        tokens = torch.tensor([token])
        yield engine.lm.decode(tokens, torch.tensor([rope + step]), torch.tensor([cache + step]))[0]


def compare(engines: dict[str, Any], reference, requests: list[tuple[str, GenerationRequest]]) -> dict[str, dict]:
    """Each engine of ``engines`` against ``reference`` over every forced step of ``requests``
    (``(task, request)`` pairs); returns ``{label: Agreement.summary()}``."""
    agreements = {label: Agreement() for label in engines}
    for task, request in requests:
        streams = {label: forced_logits(engine, request) for label, engine in engines.items()}
        for reference_logits in forced_logits(reference, request):
            for label, stream in streams.items():
                agreements[label].add(task, next(stream), reference_logits)
    return {label: a.summary() for label, a in agreements.items()}


def _options(spec: dict, threads: int | None) -> ParserOptions:
    # batch 1: one slot; the KV buffer of the longest request (prompt + forced tokens) is enough
    return ParserOptions.preset(spec["preset"], threads=threads, slots=1, **spec.get("overrides", {}))


def run(spec: dict) -> dict:
    """Load the float32 engine and every configuration of ``spec`` and compare them on the
    workload's first page (the median one).

    ``spec``: ``{"model", "threads", "workload" (dir or None), "configs": {label: {"preset",
    "overrides"}}}``.

    Returns:
        ``{"page", "requests", "results": {label: summary}}``.
    """
    from mineru_fast.bench.workload import load_workload
    from mineru_fast.engine.factory import build_engine

    page = load_workload(1, Path(spec["workload"]) if spec.get("workload") else None)[0]
    reference_options = _options(FP32, spec.get("threads"))
    reference = build_engine(Path(spec["model"]), reference_options)
    engines = {
        label: build_engine(Path(spec["model"]), _options(config, spec.get("threads")))
        for label, config in spec["configs"].items()
    }
    requests = page_requests(page, reference_options)
    return {"page": page.name, "requests": len(requests), "results": compare(engines, reference, requests)}


@dataclass
class StepGroups:
    """Forced-step agreement with the float32 engine, counted per group of steps.

    Every step counts in ``"all"``, in its block type (``"text"``, ``"table"``, ...) and in its
    token class (``"plain text"`` or ``"special"``: the forced token's id is ``SPECIAL_FROM`` or
    above); a step where the float32 engine is confident also counts in ``"confident"`` and
    ``"confident <group>"``.

    Attributes:
        counts: group -> ``[steps, top-1 equal, sum of logits cosines]``.
        cosine_min: the lowest step cosine.
        cosine_measured: no ``add`` came without cosines.
    """

    counts: dict[str, list] = field(default_factory=dict)
    cosine_min: float = 1.0
    cosine_measured: bool = True

    def add(
        self, task: str, targets: torch.Tensor, same: torch.Tensor, cosine: torch.Tensor | None, confident: torch.Tensor
    ) -> None:
        """Count a sequence's steps: ``targets`` ``[T]`` int64 forced tokens, ``same`` ``[T]`` bool
        (top-1 equal), ``cosine`` ``[T]`` float64 (None: no logits to compare, as from llama.cpp,
        whose server returns only the top log-probabilities), ``confident`` ``[T]`` bool."""
        special = targets >= SPECIAL_FROM
        masks = {"all": torch.ones_like(same), task: torch.ones_like(same), "plain text": ~special, "special": special}
        for name, mask in list(masks.items()):
            masks[f"confident {name}" if name != "all" else "confident"] = mask & confident
        for name, mask in masks.items():
            counts = self.counts.setdefault(name, [0, 0, 0.0])
            counts[0] += int(mask.sum())
            counts[1] += int((same & mask).sum())
            counts[2] += float(cosine[mask].sum()) if cosine is not None else 0.0
        if cosine is None:
            self.cosine_measured = False
        elif len(cosine):
            self.cosine_min = min(self.cosine_min, float(cosine.min()))

    def summary(self) -> dict:
        """``{group: {"steps", "top1_pct", "mean_cosine"}}`` (groups with steps; ``mean_cosine`` None
        where no cosine was given) and ``min_cosine`` (None likewise)."""
        measured = self.cosine_measured
        groups = {
            name: {"steps": n, "top1_pct": 100 * same / n, "mean_cosine": total / n if measured else None}
            for name, (n, same, total) in self.counts.items()
            if n
        }
        return {"groups": groups, "min_cosine": self.cosine_min if measured else None}


@dataclass
class ReferenceSteps:
    """The float32 engine's forced steps of one sequence: ``top1`` ``[T]`` int64, ``confident``
    ``[T]`` bool (top-1 probability >= ``CONFIDENT_P``) and ``logits`` ``[T, vocab]`` float16."""

    top1: torch.Tensor
    confident: torch.Tensor
    logits: torch.Tensor

    @classmethod
    def of(cls, logits: torch.Tensor) -> ReferenceSteps:
        """From float32 logits ``[T, vocab]``."""
        probability = torch.softmax(logits, dim=-1).amax(dim=-1)
        return cls(logits.argmax(dim=-1), probability >= CONFIDENT_P, logits.half())


@torch.inference_mode()
def forced_logits_prefill(engine, request: GenerationRequest) -> torch.Tensor:
    """Logits ``[T, vocab]`` float32 before each of the ``T`` forced tokens of ``request``
    (``<|im_end|>`` included), from one forward at batch 1 in slot 0.

    The prompt and then each forced token but the last go into one ``lm.prefill_chunks`` call as
    chunks of the same sequence (a chunk per forced token, so each gives its own last-token
    logits; a chunk attends to the cache its predecessors wrote). The linears see all ``T``
    positions at once, as a batch of ``T`` rows: per-token INT8 quantizes each row alone, as a
    decode step does, while a per-tensor activation scale covers the whole sequence.
    """
    encoded, embeds, positions = _prompt_embeds(engine, request)
    ids = encoded.input_ids
    rope = int(positions.max()) + 1
    chunks = [(embeds, positions, 0, 0)]
    forced = torch.tensor(encoded.forced[:-1], dtype=torch.long)
    forced_embeds = engine.lm.embed_tokens(forced)
    for step in range(len(forced)):
        chunks.append((forced_embeds[step : step + 1], torch.full((3, 1), rope + step), 0, len(ids) + step))
    return engine.lm.prefill_chunks(chunks)


def content_requests(
    pages: list[WorkloadPage], options: ParserOptions, count_tokens: Callable[[str], int], forced_steps: int,
    free_blocks: int,
) -> tuple[list[tuple[str, GenerationRequest]], list[tuple[str, GenerationRequest]]]:  # fmt: skip
    """The pages' content requests with ground-truth outputs, crops shrunk to ``CONTENT_IMAGE``.

    Args:
        pages: workload pages with their traces.
        options: the parser options whose sampling rules the requests carry.
        count_tokens: forced text -> its forced steps (``Preprocessor.forced_ids``' length).
        forced_steps: per block type, forced blocks are taken (in page order) until their steps
            reach this.
        free_blocks: free-running blocks per block type (the first ones).

    Returns:
        ``(forced, free)`` lists of ``(task, request)``, tasks of ``CONTENT_TASKS``; free requests
        have no forced text and at most ``FREE_TOKENS`` new tokens.
    """
    by_task: dict[str, list[GenerationRequest]] = {task: [] for task in CONTENT_TASKS}
    for page in pages:
        for task, request in page_requests(page, options)[1:]:
            if task in by_task:
                by_task[task].append(replace(request, image=request.image.resize(CONTENT_IMAGE)))
    forced: list[tuple[str, GenerationRequest]] = []
    free: list[tuple[str, GenerationRequest]] = []
    for task, requests in by_task.items():
        used = 0
        for request in requests:
            if used >= forced_steps:
                break
            forced.append((task, request))
            used += count_tokens(request.forced_text or "")
        sampling = replace(options.sampling(task), max_new_tokens=FREE_TOKENS)
        free.extend((task, replace(r, forced_text=None, sampling=sampling)) for r in requests[:free_blocks])
    return forced, free


def _free_summary(outputs: list[list[int]], reference: list[list[int]], tasks: list[str]) -> dict:
    """Free-running outputs against the float32 engine's: per block type and overall, blocks,
    identical outputs, and the median tokens before the first difference (an identical output
    counts its whole length)."""

    def prefix(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))

    rows: dict[str, list[tuple[bool, int]]] = {}
    for task, got, want in zip(tasks, outputs, reference, strict=True):
        for name in ("all", task):
            rows.setdefault(name, []).append((got == want, len(got) if got == want else prefix(got, want)))
    return {
        name: {
            "blocks": len(r),
            "identical": sum(same for same, _ in r),
            "identical_pct": 100 * sum(same for same, _ in r) / len(r),
            "median_tokens_to_divergence": statistics.median(n for _, n in r),
        }
        for name, r in rows.items()
    }


@dataclass(frozen=True)
class LlamaCppPrompt:
    """One request's prompt as llama-server takes it: ``before`` (the text up to the image, as a
    string), the image (``png_b64``), the token ids after it (``after``: the prompt's rest), and
    ``tokens``, its length in this engine's ids (image tokens included)."""

    before: str
    png_b64: str
    after: list[int]
    tokens: int


class LlamaCppSteps:
    """llama.cpp's next-token log-probabilities after a prompt and a prefix of output tokens.

    Each ``top`` call is one ``/completion`` request: the prompt as text around llama-server's
    media marker (the same image as a PNG, so the same pixels), ``n_predict`` 1 and ``n_probs``
    ``LLAMA_CPP_TOP``, which llama-server reports from the raw logits (before any sampling rule;
    a logit bias makes it sample a plain ASCII token, as it reports nothing after a token that
    ends inside a UTF-8 character).
    Successive calls on one sequence reuse slot 0's KV cache (``cache_prompt``), so each costs
    about one decode step. llama-server takes a multimodal prompt only as text, so the ids are
    decoded and llama.cpp tokenizes them again: a step whose text tokenizes back to other ids
    (a prefix ending inside a UTF-8 character, or a word piece the tokenizer would merge
    differently) cannot be asked and ``top`` returns None. Every asked prompt is checked: its
    text tokenizes back to exactly this engine's ids (``/tokenize``) and llama.cpp evaluated as
    many tokens (so its image took as many tokens as this engine's).

    Args:
        server: a running ``bench.llamacpp.LlamaServer`` of the same checkpoint's Q8_0 GGUF pair.
        preprocessor: this engine's ``Preprocessor`` (its tokenizer and chat template).

    Raises (``top``):
        BenchmarkError: llama.cpp evaluated another number of tokens than the prompt has.
        LlamaCppUnavailable: the server failed.
    """

    def __init__(self, server, preprocessor) -> None:
        self.server, self.pre = server, preprocessor
        self.marker = server.call("/props")["media_marker"]
        vocab = preprocessor.tokenizer
        self.vision_start, self.vision_end = vocab.token_to_id("<|vision_start|>"), vocab.token_to_id("<|vision_end|>")
        # The token every request samples (its probabilities are the raw logits', before any bias):
        # llama-server reports none for a sampled token that ends inside a UTF-8 character.
        self.plain_id = vocab.token_to_id("a")

    def _text(self, ids: list[int]) -> str:
        return self.pre.tokenizer.decode(ids, skip_special_tokens=False)

    def _round_trips(self, text: str, ids: list[int]) -> bool:
        return self.server.call("/tokenize", {"content": text, "parse_special": True})["tokens"] == ids

    def prompt(self, request: GenerationRequest) -> LlamaCppPrompt:
        """``request``'s prompt split at its image (one image, as every content request has).

        Raises:
            BenchmarkError: the prompt's text before the image does not tokenize back to its ids.
        """
        from mineru_fast.errors import BenchmarkError

        ids = self.pre.encode(request).input_ids.tolist()
        first = ids.index(self.pre.image_token_id)
        last = len(ids) - 1 - ids[::-1].index(self.pre.image_token_id)
        if ids[first - 1] != self.vision_start or ids[last + 1] != self.vision_end:
            raise BenchmarkError("the prompt's image is not between <|vision_start|> and <|vision_end|>")
        before = self._text(ids[: first - 1])  # llama.cpp's Qwen2-VL adds <|vision_start|> / <|vision_end|> itself
        if not self._round_trips(before + "<|vision_start|>", ids[:first]):
            raise BenchmarkError("llama.cpp tokenizes the prompt's text before the image otherwise")
        buffer = io.BytesIO()
        request.image.save(buffer, format="PNG")
        png_b64 = base64.b64encode(buffer.getvalue()).decode()
        return LlamaCppPrompt(before, png_b64, ids[last + 2 :], len(ids))

    def top(self, prompt: LlamaCppPrompt, prefix: list[int]) -> list[tuple[int, float]] | None:
        """The ``LLAMA_CPP_TOP`` most probable next tokens after ``prompt`` and ``prefix``, as
        ``(token id, log-probability)`` best first; None when the text of ``prefix`` does not
        tokenize back to its ids."""
        from mineru_fast.errors import BenchmarkError

        rest = self._text(prompt.after + prefix)
        if not self._round_trips("<|vision_end|>" + rest, [self.vision_end, *prompt.after, *prefix]):
            return None
        body = {
            "prompt": {"prompt_string": prompt.before + self.marker + rest, "multimodal_data": [prompt.png_b64]},
            "n_predict": 1, "n_probs": LLAMA_CPP_TOP, "temperature": 0.0, "cache_prompt": True, "id_slot": 0,
            "logit_bias": [[self.plain_id, 1e4]],
        }  # fmt: skip
        answer = self.server.call("/completion", body)
        if answer.get("tokens_evaluated") != prompt.tokens + len(prefix):
            raise BenchmarkError(
                f"llama.cpp evaluated {answer.get('tokens_evaluated')} tokens, the prompt has "
                f"{prompt.tokens + len(prefix)}: its image took another number of tokens"
            )
        return [(p["id"], p["logprob"]) for p in answer["completion_probabilities"][0]["top_logprobs"]]


def greedy_from_top(
    top: Callable[[list[int]], list[tuple[int, float]] | None], sampling, vocab_size: int, end_ids: list[int]
) -> tuple[list[int], str]:
    """Greedy decoding with the protocol's rules (``engine.sampling.BatchLogitsProcessor``) from a
    next-token oracle that gives only the most probable tokens.

    ``top(prefix)`` returns ``(id, log-probability)`` pairs, best first (or None: cannot be asked).
    Log-probabilities differ from logits by one constant per step, which the additive rules do
    not interact with (presence and frequency penalties subtract per token, bans set -inf), so the
    rules applied to them choose what they would choose from the logits, provided the winner is
    among the tokens given: a token not given scores at most the lowest given log-probability, so a
    winner below that is unknown. A multiplicative repetition penalty would not commute with the
    constant, hence it is refused (MinerU's requests leave it at 1.0).

    Returns:
        ``(tokens, status)``: the generated ids (the end token included when generated, as
        ``GenerationResult.token_ids``) and ``"ok"``, ``"untokenizable"`` (``top`` returned None)
        or ``"undetermined"`` (the winner could lie outside the tokens given); the tokens up to the
        step that could not be decided.

    Raises:
        ValueError: ``sampling.repetition_penalty`` is not 1.0.
    """
    from mineru_fast.engine.sampling import BatchLogitsProcessor

    if sampling.repetition_penalty != 1.0:
        raise ValueError("a repetition penalty cannot be applied to log-probabilities (it scales logits)")
    rules = BatchLogitsProcessor([sampling], [None], vocab_size, end_ids)
    tokens: list[int] = []
    while len(tokens) < sampling.max_new_tokens:
        given = top(tokens)
        if given is None:
            return tokens, "untokenizable"
        scores = torch.full((1, vocab_size), -torch.inf)
        values = torch.tensor([lp for _, lp in given], dtype=torch.float32)
        scores[0, torch.tensor([i for i, _ in given])] = values
        rules(scores)
        token = int(scores.argmax())
        if scores[0, token] < values.min():
            return tokens, "undetermined"
        rules.observe([token])
        tokens.append(token)
        if token in end_ids:
            break
    return tokens, "ok"


def _llama_cpp_row(
    spec: dict, model: Path, forced: list[tuple[str, GenerationRequest]], steps: list[ReferenceSteps],
    targets: list[torch.Tensor], free: list[tuple[str, GenerationRequest]], reference_free: list[list[int]],
    preprocessor, vocab_size: int,
) -> dict:  # fmt: skip
    """The ``LLAMA_CPP_ROW`` result: the checkpoint converted to MinerU 4's Q8_0 GGUF pair with
    llama.cpp's own converter, served by the ``llama-server`` MinerU 4 installs, with its flags
    (``bench.llamacpp``), asked through ``LlamaCppSteps``: forced steps (top-1 against the float32
    engine; no cosine: the server gives no logits) and free-running blocks (``greedy_from_top``).
    Steps and blocks that could not be asked are counted, not compared."""
    from mineru_fast.bench import llamacpp

    options = spec["llama_cpp"] if isinstance(spec["llama_cpp"], dict) else {}
    tools = llamacpp.ensure_tools(Path(options["tools"]) if options.get("tools") else None, log=_log)
    pair = llamacpp.convert_checkpoint(model, tools.root / "gguf" / model.name, tools, log=_log)
    port = llamacpp.free_port()
    args = llamacpp.server_args(pair, spec.get("threads") or os.cpu_count() or 1, port)
    groups, skipped = StepGroups(), 0
    with llamacpp.LlamaServer(tools.server, args, port) as server:
        oracle = LlamaCppSteps(server, preprocessor)
        for (task, request), ref, target in zip(forced, steps, targets, strict=True):
            prompt = oracle.prompt(request)
            asked, same = [], []
            for j in range(len(target)):
                given = oracle.top(prompt, target[:j].tolist())
                if given is None:
                    skipped += 1
                    continue
                asked.append(j)
                same.append(given[0][0] == int(ref.top1[j]))
            index = torch.tensor(asked, dtype=torch.long)
            groups.add(task, target[index], torch.tensor(same, dtype=torch.bool), None, ref.confident[index])
        outputs, statuses = [], []
        for _, request in free:
            prompt = oracle.prompt(request)
            tokens, status = greedy_from_top(
                functools.partial(oracle.top, prompt), request.sampling, vocab_size, preprocessor.end_ids
            )
            outputs.append(tokens)
            statuses.append(status)
    decided = [i for i, status in enumerate(statuses) if status == "ok"]
    free_result = {}
    if decided:
        tasks = [free[i][0] for i in decided]
        free_result = _free_summary([outputs[i] for i in decided], [reference_free[i] for i in decided], tasks)
    return {
        "config": {"engine": "llama.cpp", "files": [pair.model.name, pair.mmproj.name], **tools.versions},
        "forced": {**groups.summary(), "steps_not_asked": skipped},
        "free": {**free_result, "not_decided": [status for status in statuses if status != "ok"]},
    }


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_content(spec: dict) -> dict:
    """Real-text fidelity (see the module docstring) of every configuration of ``spec`` against
    the float32 engine, one engine loaded at a time.

    ``spec``: ``{"model", "threads", "workload" (OmniDocBench-format dir; required), "configs"
    ({label: {"preset", "overrides"}}; default ``CONTENT_CONFIGS``), "forced_steps" (per block type,
    default 1000), "free_blocks" (per block type, default 3), "pages" (default all),
    "llama_cpp" (true, or ``{"tools": DIR}``: also measure the ``LLAMA_CPP_ROW`` row)}``.

    The ``LLAMA_CPP_ROW`` row is llama.cpp's Q8_0 on the same weights, as MinerU 4 runs it on a
    CPU (``_llama_cpp_row``; its tools are installed under ``DIR``, default
    ``bench.llamacpp.default_root()``). Not asked for, or when llama.cpp's tools cannot be
    installed or run here, the row says why instead of being left out.

    Returns:
        ``{"mode": "content", "pages", "forced": {"requests", "steps"}, "free": {"blocks"},
        "rules": {...}, "results": {label: {"config", "numerics" (``engine.numerics``: what ran), "forced":
        StepGroups.summary(), "free": {...}}}}``.

    Raises:
        BenchmarkError: no workload directory, or the workload has no content block with text.
    """
    from mineru_fast.bench.workload import load_workload
    from mineru_fast.engine.factory import build_engine
    from mineru_fast.engine.preprocess import Preprocessor
    from mineru_fast.errors import BenchmarkError

    if not spec.get("workload"):
        raise BenchmarkError("real-text fidelity needs the workload's ground truth: give its directory")
    model = Path(spec["model"])
    pages = load_workload(spec.get("pages"), Path(spec["workload"]))
    options = ParserOptions()
    counter = Preprocessor(model)
    forced, free = content_requests(
        pages, options, lambda t: len(counter.forced_ids(t)), spec.get("forced_steps", 1000), spec.get("free_blocks", 3)
    )
    if not forced:
        raise BenchmarkError("the workload has no text, table or equation block with ground truth")
    configs = spec.get("configs", CONTENT_CONFIGS)  # {} (no row to compare): the reference only

    def engine_of(config: dict):
        built = _options(config, spec.get("threads"))
        return build_engine(model, built, prepared_cache=False)

    def free_run(engine) -> list[list[int]]:
        results = engine.generate([request for _, request in free])
        return [r.token_ids for r in results]

    reference = engine_of(FP32)
    steps = [ReferenceSteps.of(forced_logits_prefill(reference, request)) for _, request in forced]
    targets = [torch.tensor(reference.preprocessor.encode(request).forced) for _, request in forced]
    reference_free = free_run(reference) if free else []
    vocab_size = reference.vocab_size
    reference.close()
    del reference
    results = {}
    for label, config in configs.items():
        engine = engine_of(config)
        groups = StepGroups()
        for (task, request), ref, target in zip(forced, steps, targets, strict=True):
            logits = forced_logits_prefill(engine, request)
            same = logits.argmax(dim=-1) == ref.top1
            cosine = F.cosine_similarity(logits.double(), ref.logits.double(), dim=-1)
            groups.add(task, target, same, cosine, ref.confident)
        outputs = free_run(engine) if free else []
        numerics = dict(engine.numerics)
        engine.close()
        del engine
        results[label] = {
            "config": config,
            "numerics": numerics,
            "forced": groups.summary(),
            "free": _free_summary(outputs, reference_free, [task for task, _ in free]) if free else {},
        }
    llama_cpp: dict = {"skipped": "not asked for (spec key llama_cpp)"}
    if spec.get("llama_cpp"):
        from mineru_fast.bench.llamacpp import LlamaCppUnavailable

        try:
            llama_cpp = _llama_cpp_row(spec, model, forced, steps, targets, free, reference_free, counter, vocab_size)
        except LlamaCppUnavailable as exc:
            llama_cpp = {"skipped": f"llama.cpp unavailable: {exc}"}
    return {
        "mode": "content",
        "pages": [p.name for p in pages],
        "forced": {"requests": len(forced), "steps": sum(len(t) for t in targets)},
        "free": {"blocks": len(free), "max_new_tokens": FREE_TOKENS},
        "rules": {
            "confident": f"float32 top-1 softmax probability >= {CONFIDENT_P}",
            "special": f"forced token id >= {SPECIAL_FROM} (Qwen2-VL special tokens, end token, MinerU's own tokens)",
            "image": f"crops resized to {CONTENT_IMAGE[0]}x{CONTENT_IMAGE[1]} ({CONTENT_IMAGE_TOKENS} image tokens)",
        },
        "results": results,
        LLAMA_CPP_ROW: llama_cpp,
    }


if __name__ == "__main__":
    _spec = json.loads(sys.argv[1])
    print(json.dumps(run_content(_spec) if _spec.get("mode") == "content" else run(_spec)))

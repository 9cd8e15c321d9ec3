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

Run one comparison (the benchmark does this in a subprocess):
``python -m mineru_fast.bench.fidelity '<json spec>'`` prints one JSON line.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..engine.base import GenerationRequest
from ..options import ParserOptions
from ..page_protocol import plan_content, read_layout
from ..protocol import LAYOUT_TASK, layout_image, prompt_for
from .workload import WorkloadPage

FP32 = {"preset": "exact", "overrides": {"lm_quant": "none", "lm_head_quant": "none"}}  # the float32 engine


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


@torch.inference_mode()
def forced_logits(engine, request: GenerationRequest) -> Iterator[torch.Tensor]:
    """Logits ``[vocab]`` float32 before each forced token of ``request``, at batch 1 in slot 0:
    the prefill's, then one decode step per forced token but the last."""
    encoded = engine.preprocessor.encode(request)
    image_embeds = engine.vision_runner(encoded.pixel_values, [encoded.grid_thw])
    ids = encoded.input_ids
    embeds = engine.lm.embed_tokens(ids)
    embeds[ids == engine.preprocessor.image_token_id] = image_embeds.to(embeds.dtype)
    positions = engine.preprocessor.mrope_positions(encoded)
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
    from ..engine.factory import build_engine
    from .workload import load_workload

    page = load_workload(1, Path(spec["workload"]) if spec.get("workload") else None)[0]
    reference_options = _options(FP32, spec.get("threads"))
    reference = build_engine(Path(spec["model"]), reference_options)
    engines = {
        label: build_engine(Path(spec["model"]), _options(config, spec.get("threads")))
        for label, config in spec["configs"].items()
    }
    requests = page_requests(page, reference_options)
    return {"page": page.name, "requests": len(requests), "results": compare(engines, reference, requests)}


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))))

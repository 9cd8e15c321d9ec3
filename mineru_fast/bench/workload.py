"""Benchmark workloads: pages plus the traces to replay on them.

From a plain install the workload is synthesized from the shipped profile
(``assets/workload_profile.json``: page sizes, block types and boxes, token counts of every step's
output, taken from the OmniDocBench demo pages). Synthetic pages are blank pages of the real size
with grey bars where the blocks are; the traces hold filler outputs with the real token counts,
so the replayed cost (vision patches, prompt lengths, decode steps) equals the real pages'.
With ``--workload DIR`` the real OmniDocBench-format pages and ground truth are used instead.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from PIL import Image, ImageDraw

from mineru_fast.protocol.traces import PageTrace, build_omnidocbench_traces, load_trace
from mineru_fast.runtime.hub import cache_dir


@dataclass
class WorkloadPage:
    """One benchmark page: its image and the outputs replay forces on it."""

    name: str
    image: Image.Image
    trace: PageTrace


def load_profile(path: Path | None = None) -> list[dict]:
    """Page profiles: the shipped ones (see module docstring), or those of a JSON file of the same
    form (``{"pages": [...]}``; the tests use a one-page profile of a few tokens)."""
    if path is None:
        text = (resources.files("mineru_fast") / "assets" / "workload_profile.json").read_text(encoding="utf-8")
    else:
        text = Path(path).read_text(encoding="utf-8")
    return json.loads(text)["pages"]


def _layout_line(block: dict) -> str:
    x1, y1, x2, y2 = block["bbox"]
    kind = block["type"]
    return f"<|box_start|>{x1:03d} {y1:03d} {x2:03d} {y2:03d}<|box_end|><|ref_start|>{kind}<|ref_end|><|rotate_up|>"


def _filler(kind: str, tokens: int) -> str:
    """An output of ``tokens`` Qwen2 tokens (within 2) in the block's format."""
    if kind == "table":  # "<fcel>7" is two tokens, "<nl>" one, rows of 4 cells
        parts, used, cells = [], 0, 0
        while tokens - used >= 2:
            parts.append("<fcel>7")
            used, cells = used + 2, cells + 1
            if cells % 4 == 0 and tokens - used >= 1:
                parts.append("<nl>")
                used += 1
        return "".join(parts) + ("<nl>" if not parts or parts[-1] != "<nl>" else "")
    if kind == "equation":
        return "\\[" + " x" * max(1, tokens - 2) + "\\]"
    return " data" * max(1, tokens)


def synthesize(profile: dict) -> WorkloadPage:
    """A page image and trace with the profile's size, blocks and token counts."""
    image = Image.new("RGB", (profile["width"], profile["height"]), "white")
    draw = ImageDraw.Draw(image)
    for block in profile["blocks"]:
        x1, y1, x2, y2 = (v / 1000 * s for v, s in zip(block["bbox"], (image.width, image.height) * 2, strict=True))
        draw.rectangle((x1, y1, x2, y2), fill=(200, 200, 200))
    layout = "\n".join(_layout_line(b) for b in profile["blocks"])
    contents = [None if b["tokens"] is None else _filler(b["type"], b["tokens"]) for b in profile["blocks"]]
    return WorkloadPage(profile["name"], image, PageTrace(layout, contents))


def median_first(profiles: list[dict]) -> list[dict]:
    """Profiles ordered by closeness to the median total token count (so ``--pages 1`` is typical)."""
    totals = [p["layout_tokens"] + sum(b["tokens"] or 0 for b in p["blocks"]) for p in profiles]
    median = statistics.median(totals)
    return [p for _, p in sorted(zip(totals, profiles, strict=True), key=lambda tp: abs(tp[0] - median))]


def load_workload(
    pages: int | None = None,
    workload_dir: Path | None = None,
    cache: Path | None = None,
    profile: Path | None = None,
) -> list[WorkloadPage]:
    """The benchmark pages, median page first.

    Args:
        pages: how many pages (None: all of the profile's).
        workload_dir: real OmniDocBench-format pages (``annotations.json`` + ``images/``); None
            synthesizes them from the profile.
        cache: where traces of a real workload are built (default: the package cache, ``hub.cache_dir()``).
        profile: a page-profile JSON file (``load_profile``); None = the shipped one.
    """
    profiles = median_first(load_profile(profile))[:pages]
    if workload_dir is None:
        return [synthesize(p) for p in profiles]
    trace_dir = (cache or cache_dir()) / "traces" / workload_dir.name
    if not trace_dir.is_dir():
        build_omnidocbench_traces(workload_dir / "annotations.json", workload_dir / "images", trace_dir)
    out = []
    for entry in profiles:
        image_path = next((workload_dir / "images").glob(entry["name"] + ".*"))
        trace = load_trace(trace_dir / f"{entry['name']}.json").pages[0]
        out.append(WorkloadPage(entry["name"], Image.open(image_path).convert("RGB"), trace))
    return out

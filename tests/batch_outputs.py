"""Batch outputs compared with sequential ``mineru-fast parse``'s (``test_distributed``, ``test_batch_parts``)."""

from __future__ import annotations

import json
from pathlib import Path


def output_tree(folder: Path) -> dict[str, object]:
    """Every file below ``folder`` by relative path: bytes, or for ``<stem>.json`` (2.x layout) the
    JSON without timings (wall-clock figures differ between any two runs) and without the options'
    thread count, block confidences rounded to 3 decimals (log-prob sums in another order on 1
    thread); for MinerU 4's middle JSON and structured content the same holds of mineru-fast's
    record in their ``extensions["mineru_fast"]``."""
    out: dict[str, object] = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel in ("middle_json.json", "structured_content.json"):
            data = json.loads(path.read_text(encoding="utf-8"))
            record = data["extensions"]["mineru_fast"]
            record.pop("timings")
            record["metadata"]["options"].pop("threads")
            out[rel] = data
        elif rel.endswith(".json") and not rel.endswith("_content_list.json") and rel != "model_output.json":
            data = json.loads(path.read_text(encoding="utf-8"))
            data.pop("timings")
            # each actor runs its parser with --cores-per-actor threads, recorded in the options
            data["metadata"]["options"].pop("threads")
            for page in data["pages"]:
                page.pop("timings", None)
                for block in page["blocks"]:  # float sums in another order (1 thread vs all): ~1e-7 relative
                    for key, value in (block.get("confidence") or {}).items():
                        block["confidence"][key] = round(value, 3) if isinstance(value, float) else value
            out[rel] = data
        else:
            out[rel] = path.read_bytes()
    return out

"""Check ``mineru_fast.layout``'s post-processing against official MinerU 4's on random pages.

Loads MinerU's own PP-DocLayoutV2 post-processors from an unpacked mineru wheel (4.0.12:
``mineru/model/layout/pp_doclayout_v2_base.py`` for the ONNX backend's rules,
``pp_doclayoutv2.py`` for the transformers backend's) with their heavy imports replaced by
stand-ins (DocVortex's ``normalize_to_int_bbox``, restated here; torch, torchvision and
transformers only name classes at import time), feeds both implementations the same random
detections and threshold rows, and prints the number of pages that differ (0 expected).

    python scripts/diff_doclayout_postprocess.py --mineru-src DIR [--pages 3000] [--seed 0]

where DIR holds the ``mineru`` package (e.g. the wheel unzipped).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import random
import sys
import types
from pathlib import Path

import numpy as np

from mineru_fast.layout import LABELS, Detection, postprocess, select_rows
from mineru_fast.layout.labels import CLASS_THRESHOLDS


def _normalize_to_int_bbox(box, image_size=None):
    """DocVortex's rule: floor/ceil, clamp to (height, width), None when empty."""
    x0, y0, x1, y1 = (float(v) for v in np.asarray(box, dtype=np.float64).reshape(-1)[:4])
    x0, y0, x1, y1 = math.floor(x0), math.floor(y0), math.ceil(x1), math.ceil(y1)
    if image_size is not None:
        height, width = image_size
        x0, x1 = (max(0, min(int(width), v)) for v in (x0, x1))
        y0, y1 = (max(0, min(int(height), v)) for v in (y0, y1))
    return [x0, y0, x1, y1] if x1 > x0 and y1 > y0 else None


def _load_official(src: Path):
    layout_dir = src / "mineru" / "model" / "layout"
    stand_ins = {name: types.ModuleType(name) for name in ("docvortex", "docvortex.geometry")}
    stand_ins["docvortex.geometry"].normalize_to_int_bbox = _normalize_to_int_bbox
    for name in (
        "torchvision",
        "torchvision.transforms",
        "torchvision.transforms.v2",
        "torchvision.transforms.v2.functional",
        "transformers",
        "transformers.models.pp_doclayout_v2.configuration_pp_doclayout_v2",
        "transformers.models.pp_doclayout_v2.modeling_pp_doclayout_v2",
    ):
        module = types.ModuleType(name)
        for attr in (
            "InterpolationMode",
            "PPDocLayoutV2Config",
            "PPDocLayoutV2ForObjectDetection",
            "PPDocLayoutV2ReadingOrderConfig",
            "PPDocLayoutV2ForObjectDetectionOutput",
            "PPDocLayoutV2ReadingOrder",
        ):
            setattr(module, attr, object)
        stand_ins[name] = module
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    package = types.ModuleType("official_layout")
    package.__path__ = [str(layout_dir)]
    sys.modules["official_layout"] = package
    loaded = {}
    try:
        for name in ("pp_doclayout_v2_base", "pp_doclayoutv2"):
            spec = importlib.util.spec_from_file_location(f"official_layout.{name}", layout_dir / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            loaded[name] = module
    finally:
        for name, module in saved.items():
            sys.modules.pop(name, None)
            if module is not None:
                sys.modules[name] = module
    return loaded["pp_doclayout_v2_base"].PPDocLayoutV2PostProcessor, loaded["pp_doclayoutv2"].PPDocLayoutV2LayoutModel


def _official_regions(processor, detections, size_hw):
    boxes = []
    for index, d in enumerate(detections, start=1):
        bbox = processor._clip_bbox(list(d.bbox), size_hw)
        if bbox is not None:
            label, score = d.label, round(d.score, 4)
            boxes.append({"cls_id": LABELS.index(label), "label": label, "score": score, "bbox": bbox, "index": index})
    boxes = processor._apply_paddlex_filter_boxes(boxes, drop_inline_formula=False)
    boxes = processor._apply_layout_post_process(boxes, image_size=size_hw)
    return [(b["label"], b["score"], tuple(float(v) for v in b["bbox"])) for b in boxes]


def _random_page(rng: random.Random, width: int, height: int) -> list[Detection]:
    boxes, out = [], []
    for _ in range(rng.randint(0, 40)):
        if boxes and rng.random() < 0.4:  # near-duplicates and nested boxes exercise every rule
            x0, y0, x1, y1 = rng.choice(boxes)
            if rng.random() < 0.3:
                cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
                w, h = (x1 - x0) * rng.uniform(0.1, 0.6), (y1 - y0) * rng.uniform(0.1, 0.6)
                box = (cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2)
            else:
                box = tuple(v + rng.uniform(-15, 15) for v in (x0, y0, x1, y1))
        else:
            x0, y0 = rng.uniform(-20, width), rng.uniform(-20, height)
            box = (x0, y0, x0 + rng.uniform(1, width / 2), y0 + rng.uniform(1, height / 4))
        boxes.append(box)
        out.append(Detection(rng.choice(LABELS), rng.uniform(0.4, 1.0), box))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mineru-src", type=Path, required=True)
    ap.add_argument("--pages", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    onnx_rules, torch_rules = _load_official(args.mineru_src)
    rng = random.Random(args.seed)
    differing = {"onnx": 0, "torch": 0}
    for _ in range(args.pages):
        width, height = rng.choice([(1000, 1400), (1400, 1000), (800, 800)])
        detections = _random_page(rng, width, height)
        for rules, processor in (("onnx", onnx_rules), ("torch", torch_rules)):
            ours = [(d.label, d.score, d.bbox) for d in postprocess(detections, (width, height), rules)]
            differing[rules] += ours != _official_regions(processor, detections, (height, width))
    namespace: dict = {"np": np, "DEFAULT_CLASS_THRESHOLDS": list(CLASS_THRESHOLDS)}
    source = (args.mineru_src / "mineru/model/layout/pp_doclayout_v2_onnx.py").read_text(encoding="utf-8")
    start = source.index("    @staticmethod\n    def _filter_by_class_thresholds")
    method = source[start : source.index("    def _run_session")]
    exec("class Official:\n" + method, namespace)  # MinerU's ONNX row filter, run as published
    rows_differing = 0
    for _ in range(args.pages):
        rows = []
        for _query in range(rng.randint(0, 30)):
            geometry = [rng.uniform(0, 500) for _ in range(4)] + [float(rng.randint(0, 10)), rng.random()]
            for label in rng.sample(range(len(LABELS)), rng.randint(1, 3)):
                rows.append([float(label), round(rng.uniform(0.3, 1.0), 2), *geometry])
        rows = np.array(rows, dtype=np.float32).reshape(-1, 8)
        official = namespace["Official"]._filter_by_class_thresholds(rows)
        official = official[np.lexsort((-official[:, 7], official[:, 6]))] if len(official) else official
        ours = [(d.label, d.score, d.bbox) for d in select_rows(rows)]
        theirs = [(LABELS[int(r[0])], float(r[1]), tuple(float(v) for v in r[2:6])) for r in official]
        rows_differing += ours != theirs
    print(f"pages differing: onnx rules {differing['onnx']}, torch rules {differing['torch']} of {args.pages}")
    print(f"row sets differing (threshold + order): {rows_differing} of {args.pages}")


if __name__ == "__main__":
    main()

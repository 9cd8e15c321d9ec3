"""PP-DocLayoutV2's classes and MinerU 4's use of them (facts, no code).

Sources: the 25 labels in class-id order, the per-class score thresholds and the reading-order
class remap are the published model's (``id2label``, ``class_thresholds`` and ``class_order`` of
PaddlePaddle's PP-DocLayoutV2, as MinerU 4.0.12 restates them in
``mineru/model/layout/pp_doclayout_v2_base.py``). The label -> block-type map is MinerU 4.0.12's
``VLM_LAYOUT_LABEL_MAP`` (``backend/analysis/pdf/constants.py``): labels it leaves out
(``inline_formula``, ``reference``) produce no block.
"""

from __future__ import annotations

__all__ = [
    "LABEL_BY_BLOCK_TYPE",
    "LABELS",
    "LABEL_IDS",
    "CLASS_THRESHOLDS",
    "CLASS_ORDER",
    "BLOCK_TYPE_BY_LABEL",
    "INPUT_SIZE",
]

# Model input (height, width) in pixels: the published inference.yml resizes to 800x800.
INPUT_SIZE = (800, 800)

LABELS: tuple[str, ...] = (
    "abstract",
    "algorithm",
    "aside_text",
    "chart",
    "content",
    "display_formula",
    "doc_title",
    "figure_title",
    "footer",
    "footer_image",
    "footnote",
    "formula_number",
    "header",
    "header_image",
    "image",
    "inline_formula",
    "number",
    "paragraph_title",
    "reference",
    "reference_content",
    "seal",
    "table",
    "text",
    "vertical_text",
    "vision_footnote",
)

LABEL_IDS: dict[str, int] = {label: i for i, label in enumerate(LABELS)}

# Minimum sigmoid score per class id (same order as LABELS).
CLASS_THRESHOLDS: tuple[float, ...] = (
    0.5, 0.5, 0.5, 0.5, 0.5, 0.4, 0.4, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5,
    0.5, 0.5, 0.4, 0.5, 0.4, 0.5, 0.5, 0.45, 0.5, 0.4, 0.4, 0.5,
)  # fmt: skip

# Class id -> category id the reading-order head was trained on (same order as LABELS).
CLASS_ORDER: tuple[int, ...] = (
    4, 2, 14, 1, 5, 7, 8, 6, 11, 11, 9, 13, 10, 10, 1, 2, 3, 0, 2, 2, 12, 1, 2, 15, 6,
)  # fmt: skip

# Detector label -> MinerU block type (mineru-vl-utils 2.x names; "caption", "footnote" and
# "formula_number" are the raw types MinerU later assigns to tables, images or equations).
BLOCK_TYPE_BY_LABEL: dict[str, str] = {
    "abstract": "text",
    "algorithm": "code",
    "aside_text": "aside_text",
    "chart": "chart",
    "content": "index",
    "display_formula": "equation",
    "doc_title": "doc_title",
    "figure_title": "caption",
    "footer": "footer",
    "footer_image": "footer",
    "footnote": "page_footnote",
    "formula_number": "formula_number",
    "header": "header",
    "header_image": "header",
    "image": "image",
    "number": "page_number",
    "paragraph_title": "paragraph_title",
    "reference_content": "ref_text",
    "seal": "image",
    "table": "table",
    "text": "text",
    "vertical_text": "text",
    "vision_footnote": "footnote",
}

# MinerU2.5 (mineru-vl-utils) block type -> the PP-DocLayoutV2 label that yields it, so a VLM
# layout (from a VLM trace or ground truth) can be replayed through the standard tier. Types the
# detector has no class for map to the nearest one: titles to paragraph_title, lists and
# phonetic blocks to text, equation blocks to display_formula, visual captions/footnotes to
# figure_title/vision_footnote.
LABEL_BY_BLOCK_TYPE: dict[str, str] = {
    "text": "text",
    "title": "paragraph_title",
    "doc_title": "doc_title",
    "paragraph_title": "paragraph_title",
    "table": "table",
    "image": "image",
    "chart": "chart",
    "equation": "display_formula",
    "equation_block": "display_formula",
    "formula_number": "formula_number",
    "code": "algorithm",
    "algorithm": "algorithm",
    "aside_text": "aside_text",
    "ref_text": "reference_content",
    "index": "content",
    "phonetic": "text",
    "list": "text",
    "list_item": "text",
    "caption": "figure_title",
    "table_caption": "figure_title",
    "image_caption": "figure_title",
    "code_caption": "figure_title",
    "footnote": "vision_footnote",
    "table_footnote": "vision_footnote",
    "image_footnote": "vision_footnote",
    "header": "header",
    "footer": "footer",
    "page_number": "number",
    "page_footnote": "footnote",
}

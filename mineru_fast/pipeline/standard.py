"""The ``standard`` tier's page plan: which blocks take their text from the PDF, which the VLM reads.

Pure functions (no torch, no parser). For one page, ``plan_page`` takes the layout detector's
blocks (``layout.PageLayout``) and, on a ``"txt"`` page, the PDF's text layer, and returns the
blocks with text filled from the PDF where MinerU 4 fills it, plus the list of VLM reads still
needed, in the manner of mineru-vl-utils' extract-with-layout path
(``MinerUClient.batch_extract_with_layout`` as MinerU 4.0.12's ``high`` effort calls it from
``backend/analysis/pdf/window.py``). ``finish_page`` puts the VLM's outputs back.

On a ``"txt"`` page (MinerU 4.0.12's ``parse_mode="txt"``):

- blocks of the types in ``TEXT_FROM_PDF`` (MinerU's ``NOT_EXTRACT_TYPES``: text, titles,
  headers/footers, page numbers, page footnotes, references, captions and footnotes of tables,
  images and code, phonetic) take their text from the PDF (``pdftext.block_text``); one whose
  PDF text is empty or untrustworthy is read by the VLM instead (MinerU re-reads such text with
  OCR), never filled with garbage;
- the ``inline_formula`` regions inside those blocks are read by the VLM as formulas (MinerU
  recognizes them with its own formula model, PP-FormulaNet, and splices ``\\(latex\\)`` into the
  text; here the VLM's "Formula Recognition" does that job) and spliced the same way; a formula
  not read keeps the PDF's characters;
- every other block is read by the VLM.

On an ``"ocr"`` page (a scan, an image input, a garbled text layer) every block is read by the
VLM. Either way, like mineru-vl-utils, ``list``, ``equation_block`` and ``image_block`` blocks
are never read, and ``image``/``chart`` blocks only with ``image_analysis`` (off in MinerU's
``high`` effort).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from mineru_fast.inputs.pdftext.assemble import FORMULA, block_text
from mineru_fast.inputs.pdftext.chars import PageText
from mineru_fast.inputs.pdftext.classify import page_verdict
from mineru_fast.layout.postprocess import LayoutBlock, PageLayout
from mineru_fast.protocol import page as page_protocol

__all__ = [
    "TEXT_FROM_PDF",
    "NEVER_READ",
    "IMAGE_ANALYSIS",
    "VlmRead",
    "PagePlan",
    "plan_page",
    "finish_page",
    "protocol_layout",
    "pdf_contents",
]

# MinerU 4.0.12 backend/analysis/pdf/constants.py NOT_EXTRACT_TYPES.
TEXT_FROM_PDF: frozenset[str] = frozenset(
    {
        "text", "title", "doc_title", "paragraph_title", "header", "footer", "page_number", "page_footnote",
        "ref_text", "table_caption", "image_caption", "caption", "table_footnote", "image_footnote",
        "footnote", "code_caption", "phonetic",
    }
)  # fmt: skip
# mineru-vl-utils 2.0.7 MinerUClientHelper.prepare_for_extract: never read / read only with image_analysis.
NEVER_READ: frozenset[str] = frozenset({"list", "equation_block", "image_block"})
IMAGE_ANALYSIS: frozenset[str] = frozenset({"image", "chart"})
INLINE_FORMULA_TYPE = "equation"  # the VLM task an inline formula is read with ("Formula Recognition")
_DELIMITERS = re.compile(r"^\s*(?:\\\[|\$\$|\\\(|\$)(.*?)(?:\\\]|\$\$|\\\)|\$)\s*$", re.S)

Box = tuple[float, float, float, float]


@dataclass(frozen=True)
class VlmRead:
    """One crop the VLM must read.

    Attributes:
        type: the task type (selects prompt, sampling and post-processing): the block's type, or
            ``"equation"`` for an inline formula.
        bbox: crop box normalized to the page (0..1).
        angle: the block's angle (0, 90, 180, 270) as mineru-vl-utils uses it: the crop is turned
            with ``PIL.Image.rotate(angle, expand=True)`` before reading, as for blocks of the
            VLM's own layout. The detector gives 0 (MinerU's table-orientation classifier, which
            can set 90/180/270 on tables, is not part of this tier yet).
        block: index of the block in ``PagePlan.blocks`` whose content the output becomes, or
            None for an inline formula.
        formula: index of the inline formula (``PageLayout.inline_formulas``), or None.
    """

    type: str
    bbox: Box
    angle: int = 0
    block: int | None = None
    formula: int | None = None


@dataclass
class PagePlan:
    """A page's blocks and the VLM reads they still need.

    Attributes:
        blocks: the layout's blocks in reading order, ``content`` filled from the PDF where it
            was (with ``pdftext.FORMULA`` placeholders for inline formulas), None where the VLM
            reads it or nobody does.
        reads: the VLM reads, blocks first (in reading order), then inline formulas.
        mode: the page's mode, ``"txt"`` or ``"ocr"``.
        reason: why (the text-layer check that decided, or "requested").
        formula_text: the PDF's characters of each inline formula placed in a block, used when
            its read is missing.
    """

    blocks: list[LayoutBlock]
    reads: list[VlmRead]
    mode: str
    reason: str
    formula_text: dict[int, str] = field(default_factory=dict)


def plan_page(layout: PageLayout, text: PageText | None, mode: str, image_analysis: bool = False) -> PagePlan:
    """Decide, for one page, what the PDF fills and what the VLM reads.

    Args:
        layout: the page's layout (blocks in reading order and inline-formula boxes, normalized).
        text: the page's text layer (``pdftext.read_page_text``); None for images.
        mode: the document's resolved mode, ``"txt"`` or ``"ocr"``; a ``"txt"`` page whose own
            text layer fails ``pdftext.page_verdict`` (or that has none) is planned as ``"ocr"``.
        image_analysis: also read ``image`` and ``chart`` blocks.

    Returns:
        The plan.

    Raises:
        ValueError: ``mode`` is neither ``"txt"`` nor ``"ocr"``.
    """
    if mode not in ("txt", "ocr"):
        raise ValueError(f"mode must be 'txt' or 'ocr', got {mode!r}")
    reason = "requested"
    if mode == "txt":
        verdict = page_verdict(text) if text is not None else None
        if verdict is None or verdict.mode == "ocr":
            mode, reason = "ocr", verdict.reason if verdict else "no text layer"
        else:
            reason = verdict.reason
    blocks: list[LayoutBlock] = []
    reads: list[VlmRead] = []
    formulas_used: list[int] = []
    taken: set[int] = set()
    formulas_taken: set[int] = set()
    for index, block in enumerate(layout.blocks):
        content = None
        if mode == "txt" and text is not None and block.type in TEXT_FROM_PDF:
            free = [None if k in formulas_taken else f for k, f in enumerate(layout.inline_formulas)]
            assembled = block_text(text, block.bbox, free, skip=taken)
            if (assembled.chars or assembled.formulas) and not assembled.suspicious:
                content = assembled.text
                taken.update(assembled.used)
                formulas_taken.update(assembled.formulas)
                formulas_used.extend(assembled.formulas)
        if content is None and _is_read(block.type, image_analysis):
            reads.append(VlmRead(block.type, block.bbox, block.angle, block=index))
        blocks.append(replace(block, content=content))
    formula_text = {}
    for k in formulas_used:
        box = layout.inline_formulas[k]
        formula_text[k] = block_text(text, box).text if text is not None else ""
        reads.append(VlmRead(INLINE_FORMULA_TYPE, box, 0, formula=k))
    return PagePlan(blocks, reads, mode, reason, formula_text)


def _is_read(block_type: str, image_analysis: bool) -> bool:
    if block_type in NEVER_READ:
        return False
    return image_analysis or block_type not in IMAGE_ANALYSIS


def _latex(output: str) -> str:
    """An equation read's LaTeX without display or inline delimiters."""
    found = _DELIMITERS.match(output)
    return (found.group(1) if found else output).strip()


def finish_page(plan: PagePlan, outputs: Sequence[str | None]) -> list[LayoutBlock]:
    """The page's final blocks, the VLM's outputs put in.

    Args:
        plan: ``plan_page``'s result.
        outputs: one text per ``plan.reads`` entry, post-processed for its type, or None for a
            read that produced nothing (a failed or skipped request).

    Returns:
        The blocks in reading order. A block read by the VLM takes its output; an inline formula
        becomes ``\\(latex\\)`` in its block's text (nothing when the VLM read it as empty, as
        MinerU drops an empty formula; the PDF's characters when it was not read).

    Raises:
        ValueError: ``outputs`` does not have one entry per read.
    """
    if len(outputs) != len(plan.reads):
        raise ValueError(f"{len(outputs)} outputs for {len(plan.reads)} reads")
    blocks = list(plan.blocks)
    latex: dict[int, str | None] = {}
    for read, output in zip(plan.reads, outputs, strict=True):
        if read.block is not None:
            blocks[read.block] = replace(blocks[read.block], content=output)
        elif read.formula is not None:
            latex[read.formula] = None if output is None else _latex(output)

    def splice(match: re.Match) -> str:
        k = int(match.group(1))
        value = latex.get(k)
        if value is None:
            return plan.formula_text.get(k, "")
        return f"\\({value}\\)" if value else ""

    for i, block in enumerate(blocks):
        if block.content and FORMULA.search(block.content):
            text = FORMULA.sub(splice, block.content)
            blocks[i] = replace(block, content=re.sub(r" {2,}", " ", text).strip())
    return blocks


def protocol_layout(plan: PagePlan) -> page_protocol.PageLayout:
    """The plan's blocks as the VLM protocol's layout (``protocol.page.layout_from_blocks``), no
    content: what mineru-vl-utils' extract-with-layout path reads and post-processes. The
    PDF's text is set after post-processing (``pdf_contents``, ``results.finish.finish_blocks``)."""
    return page_protocol.layout_from_blocks([(b.type, b.bbox, b.angle, b.sub_type) for b in plan.blocks])


def pdf_contents(plan: PagePlan, formula_outputs: dict[int, str | None]) -> dict[int, str]:
    """The final text of the blocks the PDF filled, inline formulas spliced in.

    Args:
        plan: ``plan_page``'s result.
        formula_outputs: inline formula index -> the VLM's raw output, or None where it failed;
            a formula missing here keeps the PDF's characters.

    Returns:
        Block index (in ``plan.blocks``) -> text, for every block whose text came from the PDF.
    """
    outputs = [formula_outputs.get(read.formula) if read.formula is not None else None for read in plan.reads]
    done = finish_page(plan, outputs)
    return {i: done[i].content or "" for i, block in enumerate(plan.blocks) if block.content is not None}

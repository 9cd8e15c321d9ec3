"""A PDF's own text layer: when to trust it (``ocr_mode``) and the text inside a layout block.

>>> verdict = resolve_ocr_mode("auto", pdf)          # "txt" for born-digital PDFs, "ocr" for scans
>>> page_text = read_page_text(pdf[0])               # characters with boxes on the displayed page
>>> block_text(page_text, (0.1, 0.1, 0.5, 0.3)).text

Modules: ``chars`` (reading the characters with PDFium), ``classify`` (``ocr_mode="auto"``,
MinerU 4's checks), ``assemble`` (a block's text, MinerU 4's rules). Functions that take PDFium
objects expect the caller to serialize PDFium calls (PDFium is not thread-safe;
``inputs`` holds the process's lock).
"""

from mineru_fast.inputs.pdftext.assemble import FORMULA, BlockText, block_text, merge_lines
from mineru_fast.inputs.pdftext.chars import PageText, PdfChar, read_page_text
from mineru_fast.inputs.pdftext.classify import (
    OCR_MODES,
    TextLayerVerdict,
    classify_pdf,
    page_verdict,
    resolve_ocr_mode,
)

__all__ = [
    "FORMULA",
    "BlockText",
    "block_text",
    "merge_lines",
    "PageText",
    "PdfChar",
    "read_page_text",
    "OCR_MODES",
    "TextLayerVerdict",
    "classify_pdf",
    "page_verdict",
    "resolve_ocr_mode",
]

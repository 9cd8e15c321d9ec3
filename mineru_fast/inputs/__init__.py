"""Inputs, the first layer of a parse: documents in (PDF and images, ``documents``), RGB page images
out; the PDF's own text layer (``pdftext``); which files a command reads and where their results
go (``paths``); and what the HTTP client uploads (``upload``).

>>> from mineru_fast.inputs import open_document
>>> opened = open_document("paper.pdf")  # OpenedDocument: name, page count, pages rendered on demand
"""

from mineru_fast.inputs.documents import OpenedDocument, open_document

__all__ = ["OpenedDocument", "open_document"]

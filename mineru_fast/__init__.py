"""mineru-fast: run the MinerU2.5 document-parsing VLM fast on CPUs.

>>> from mineru_fast import DocumentParser
>>> parser = DocumentParser.from_pretrained()  # MinerU2.5-Pro-2605, as MinerU 4; or a hub id or local dir
>>> doc = parser.parse("paper.pdf", pages="1-3")
>>> doc.save("out/")
"""

from typing import TYPE_CHECKING, Any

from mineru_fast._version import __version__
from mineru_fast.errors import (
    CorruptDocument,
    ImageTooLarge,
    InputError,
    MineruFastError,
    ModelLoadError,
    ModelNotCached,
    PageRangeError,
    PasswordRequired,
    TraceError,
    UnsupportedFormat,
)
from mineru_fast.inputs.documents import open_document
from mineru_fast.options import PRESETS, ParserOptions
from mineru_fast.results.document import Document
from mineru_fast.results.metadata import InputInfo
from mineru_fast.results.page import Block, Confidence, Page, ParseError
from mineru_fast.results.writer import DocumentWriter
from mineru_fast.runtime.hub import ModelInfo

if TYPE_CHECKING:
    from mineru_fast.client import AsyncClient, Client
    from mineru_fast.pipeline.parser import DocumentParser

__all__ = [
    "__version__",
    "DocumentParser",
    "ParserOptions",
    "ModelInfo",
    "Client",
    "AsyncClient",
    "PRESETS",
    "Document",
    "DocumentWriter",
    "InputInfo",
    "open_document",
    "Page",
    "Block",
    "Confidence",
    "ParseError",
    "MineruFastError",
    "InputError",
    "UnsupportedFormat",
    "CorruptDocument",
    "PasswordRequired",
    "ImageTooLarge",
    "PageRangeError",
    "ModelLoadError",
    "ModelNotCached",
    "TraceError",
]


def __getattr__(name: str) -> Any:
    # DocumentParser imports torch; loading it lazily lets the CLI set OpenMP variables first.
    # The HTTP clients import httpx, which parsing alone does not need.
    if name == "DocumentParser":
        from mineru_fast.pipeline.parser import DocumentParser

        return DocumentParser
    if name in ("Client", "AsyncClient"):
        from mineru_fast import client

        return getattr(client, name)
    raise AttributeError(f"module 'mineru_fast' has no attribute {name!r}")

"""mineru-fast: run the MinerU2.5 document-parsing VLM fast on CPUs.

>>> from mineru_fast import DocumentParser
>>> parser = DocumentParser.from_pretrained("opendatalab/MinerU2.5-2509-1.2B")  # or a local dir
>>> doc = parser.parse("paper.pdf", pages="1-3")
>>> doc.save("out/")
"""

from typing import TYPE_CHECKING, Any

from .document import Block, Confidence, Document, Page, ParseError
from .errors import (
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
from .hub import ModelInfo
from .options import PRESETS, ParserOptions

# The one version source: pyproject.toml reads it (setuptools dynamic version, parsed without import).
__version__ = "0.1.0"

if TYPE_CHECKING:
    from .client import AsyncClient, Client
    from .parser import DocumentParser

__all__ = [
    "__version__",
    "DocumentParser",
    "ParserOptions",
    "ModelInfo",
    "Client",
    "AsyncClient",
    "PRESETS",
    "Document",
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
        from .parser import DocumentParser

        return DocumentParser
    if name in ("Client", "AsyncClient"):
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module 'mineru_fast' has no attribute {name!r}")

"""mineru-fast: run the MinerU2.5 document-parsing VLM fast on CPUs.

>>> from mineru_fast import DocumentParser
>>> parser = DocumentParser.from_pretrained("opendatalab/MinerU2.5-2509-1.2B")  # or a local dir
>>> doc = parser.parse("paper.pdf", pages="1-3")
>>> doc.save("out/")
"""

from .document import Block, Document, Page
from .errors import (
    CorruptDocument,
    ImageTooLarge,
    InputError,
    MineruFastError,
    ModelLoadError,
    PageRangeError,
    PasswordRequired,
    TraceError,
    UnsupportedFormat,
)
from .options import PRESETS, ParserOptions

__version__ = "0.1.0"

__all__ = [
    "DocumentParser",
    "ParserOptions",
    "PRESETS",
    "Document",
    "Page",
    "Block",
    "MineruFastError",
    "InputError",
    "UnsupportedFormat",
    "CorruptDocument",
    "PasswordRequired",
    "ImageTooLarge",
    "PageRangeError",
    "ModelLoadError",
    "TraceError",
]


def __getattr__(name: str):
    # DocumentParser imports torch; loading it lazily lets the CLI set OpenMP variables first.
    if name == "DocumentParser":
        from .parser import DocumentParser

        return DocumentParser
    raise AttributeError(f"module 'mineru_fast' has no attribute {name!r}")

"""Which files a command reads, and where their results go: the files of a folder input, and the
inputs whose results would overwrite each other (each input writes ``OUTPUT/<stem>/``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, TypeVar

__all__ = ["INPUT_SUFFIXES", "expand_inputs", "output_clashes", "clash_message"]


INPUT_SUFFIXES = frozenset({".pdf", ".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp", ".webp", ".gif", ".jp2"})
"""Suffixes taken from a directory input (files named explicitly are read whatever their name)."""


def expand_inputs(inputs: list[Path]) -> list[Path]:
    """Files as given; a directory becomes its files with a document or image suffix, sorted."""
    out: list[Path] = []
    for path in inputs:
        if path.is_dir():
            out.extend(sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in INPUT_SUFFIXES))
        else:
            out.append(path)
    return out


class _Stemmed(Protocol):
    @property
    def stem(self) -> str: ...


_Input = TypeVar("_Input", bound=_Stemmed)


def output_clashes(sources: Sequence[_Input]) -> list[tuple[_Input, _Input]]:
    """Pairs of distinct inputs with the same stem: each input writes ``OUTPUT/<stem>/``, so such a
    pair would overwrite one result with the other. Empty when every stem is unique.

    Args:
        sources: inputs with a ``stem`` (``Path``, ``distributed.sources.Source``).
    """
    first: dict[str, _Input] = {}
    clashes = []
    for source in sources:
        seen = first.setdefault(source.stem, source)
        if seen != source:
            clashes.append((seen, source))
    return clashes


def clash_message(first: Path, second: Path) -> str:
    """The one line that reports a pair of ``output_clashes``."""
    return f"{first} and {second} would both write {first.stem}/: rename one"

"""The inputs of ``mineru-fast batch``: local files, directories and globs, and pyarrow filesystem URIs.

A local input is a file, a directory (its files with a document or image suffix, recursively:
``inputs.paths.expand_inputs``) or a glob (``*``, ``?``, ``[...]``, ``**``; quoted, so that the
shell leaves it alone). A local file is read on the driver's machine (by a Ray Data inspection
task placed there, and for the actors by the batch's ledger actor there) and its bytes travel to
the actors, so the nodes need no shared file system.

A URI input (``scheme://...``) is opened with ``pyarrow.fs.FileSystem.from_uri``: whatever
pyarrow supports (``file://``, ``s3://``, ``gs://``, ``hdfs://``, with their query options). It
names a file, a directory (listed recursively with ``FileSelector``, files with a document or image
suffix) or a glob whose ``*`` matches within one path segment and whose ``**`` segment matches any
number of segments, none included, as in a local recursive glob (the only wildcards: ``?`` starts a
URI's query and ``[`` is not allowed in one). A URI
document is read where it is inspected and again by each actor that parses a task of it (the
``Source`` carries the pyarrow filesystem, which pickles), so its bytes never travel through Ray;
every node must reach the store (for ``file://``: the same path on every node, e.g. a shared
mount).
"""

from __future__ import annotations

import glob
import re
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath
from typing import Any

from mineru_fast.errors import SourceError
from mineru_fast.inputs.paths import INPUT_SUFFIXES, expand_inputs

__all__ = ["Source", "list_sources", "is_uri"]

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_GLOB_CHARS = re.compile(r"[*?\[]")


def is_uri(text: str) -> bool:
    """True when ``text`` starts with a URI scheme and ``://`` (``s3://bucket/key``, ``file:///tmp``)."""
    return bool(_URI.match(text))


@dataclass(frozen=True)
class Source:
    """One input document.

    Attributes:
        location: what the manifest shows: the local path as given, or the file's URI.
        path: the local path, or the file's path within ``filesystem``.
        filesystem: the ``pyarrow.fs.FileSystem`` of a URI input (the actors read the file); None
            for a local file (read on the driver's machine, its bytes sent to the actors).
    """

    location: str
    path: str
    filesystem: Any = None

    @property
    def stem(self) -> str:
        """The output name: the file name without its suffix (``OUTPUT/<stem>/``)."""
        return PurePosixPath(self.path).stem if self.filesystem is not None else Path(self.path).stem

    def read(self) -> bytes:
        """The file's bytes.

        Raises:
            SourceError: the file cannot be read (missing, permissions, the store unreachable).
        """
        try:
            if self.filesystem is None:
                return Path(self.path).read_bytes()
            with self.filesystem.open_input_stream(self.path) as stream:
                return bytes(stream.readall())
        except OSError as exc:
            raise SourceError(f"cannot read {self.location}: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    """An exception's first message line (pyarrow's can run to dozens of lines)."""
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def _uri_of(uri: str, path: str) -> str:
    """The URI of ``path`` on the filesystem of ``uri`` (``s3://b/k`` gives paths ``b/k``, ``file:///x`` ``/x``)."""
    scheme, _, rest = uri.partition("://")
    if path.startswith("/"):
        authority = rest.split("/", 1)[0] if not rest.startswith("/") else ""
        return f"{scheme}://{authority}{path}"
    return f"{scheme}://{path}"


def _matches(path: str, pattern: str) -> bool:
    """``path`` matches ``pattern`` segment by segment: ``*`` within one segment, a ``**`` segment
    any number of whole segments (none included); no other wildcard."""
    parts, wanted = path.strip("/").split("/"), pattern.strip("/").split("/")
    literal = [w.replace("[", "[[]").replace("?", "[?]") for w in wanted]  # fnmatch's other wildcards
    return _match_segments(parts, literal)


def _match_segments(parts: list[str], wanted: list[str]) -> bool:
    if not wanted:
        return not parts
    if wanted[0] == "**":
        return any(_match_segments(parts[i:], wanted[1:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatchcase(parts[0], wanted[0]) and _match_segments(parts[1:], wanted[1:])


def _list_uri(uri: str) -> list[Source]:
    try:
        from pyarrow import fs
    except ImportError as exc:
        raise SourceError(f"URI inputs need pyarrow: pip install 'mineru-fast[ray]' ({uri})") from exc
    try:
        filesystem, path = fs.FileSystem.from_uri(uri)
        star = path.find("*")
        pattern = None if star < 0 else path
        base = path if star < 0 else path[:star].rpartition("/")[0]
        info = filesystem.get_file_info(base)
        if info.type == fs.FileType.File and pattern is None:
            return [Source(uri, path, filesystem)]
        if info.type != fs.FileType.Directory:
            raise SourceError(f"no such file or directory: {uri}")
        found = filesystem.get_file_info(fs.FileSelector(base, recursive=True))
    except (OSError, ValueError) as exc:  # ValueError: pyarrow.ArrowInvalid, an unsupported scheme
        raise SourceError(f"cannot list {uri}: {_first_line(exc)}") from exc
    files = sorted(i.path for i in found if i.type == fs.FileType.File)
    if pattern is None:
        files = [f for f in files if PurePosixPath(f).suffix.lower() in INPUT_SUFFIXES]
    else:
        files = [f for f in files if _matches(f, pattern)]
    return [Source(_uri_of(uri, f), f, filesystem) for f in files]


def _list_local(text: str) -> list[Source]:
    path = Path(text)
    if path.exists():
        return [Source(str(p), str(p)) for p in expand_inputs([path])]
    if _GLOB_CHARS.search(text):
        return [Source(p, p) for p in sorted(glob.glob(text, recursive=True)) if Path(p).is_file()]
    raise SourceError(f"no such file or directory: {text}")


def list_sources(inputs: Sequence[str | Path]) -> list[Source]:
    """The documents named by ``inputs`` (see the module docstring), in the order given, each
    directory's or glob's files sorted.

    Args:
        inputs: local paths, directories, globs, or pyarrow filesystem URIs (as text).

    Returns:
        One ``Source`` per file (a glob or directory with no matching file contributes none).

    Raises:
        SourceError: an unsupported URI scheme, a path that does not exist, a store that cannot be
            listed, or a URI input without pyarrow installed.
    """
    sources: list[Source] = []
    for text in map(str, inputs):
        sources.extend(_list_uri(text) if is_uri(text) else _list_local(text))
    return sources

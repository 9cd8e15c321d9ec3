"""Mutated documents for fuzzing the input layer (``tests/test_fuzz_inputs.py``, ``benchmarks/fuzz_inputs.py``).

Seeds are small files made here (PNG, JPEG, multi-frame TIFF, PDF, GIF, WebP, BMP, 16-bit PNG)
plus, where present, the shared corpus's files under a size cap. A mutation is one to three of:
flipped bytes (mostly in the first KiB, where headers live), extreme integers written over header
fields (sizes, offsets, counts), a truncation, an inserted, deleted or duplicated chunk, or a splice
of two seeds. Everything is drawn from one ``random.Random``, so an input is reproducible from its
seed number (or, under hypothesis, from the example it reports).
"""

from __future__ import annotations

import random
import struct
from pathlib import Path

from PIL import Image
from samples import image_bytes, pdf_bytes, text_page

from mineru_fast.errors import InputError

__all__ = ["made_seeds", "corpus_seeds", "mutate", "check_parse"]

_EXTREMES = (0, 1, 0x7F, 0xFF, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF)


def made_seeds() -> dict[str, bytes]:
    """Small documents of every input kind the parser reads, made with Pillow."""
    page = text_page(size=(425, 550), lines=6)
    frames = [page, Image.new("1", (96, 64), 1), Image.new("L", (64, 96), 128)]
    gray16 = Image.new("I;16", (64, 48), 40000)
    return {
        "page.png": image_bytes(page, "PNG"),
        "page.jpg": image_bytes(page, "JPEG", quality=60),
        "frames.tif": image_bytes(frames[0], "TIFF", save_all=True, append_images=frames[1:]),
        "frames_lzw.tif": image_bytes(
            frames[0], "TIFF", save_all=True, append_images=frames[1:], compression="tiff_lzw"
        ),
        "page.pdf": pdf_bytes(1),
        "page.gif": image_bytes(page.convert("P"), "GIF"),
        "page.webp": image_bytes(page, "WEBP", quality=50),
        "page.bmp": image_bytes(page.resize((120, 160)), "BMP"),
        "gray16.png": image_bytes(gray16, "PNG"),
        "rgba.png": image_bytes(page.convert("RGBA").resize((150, 200)), "PNG"),
    }


def corpus_seeds(corpus: Path, max_bytes: int, max_pages: int | None = None) -> dict[str, bytes]:
    """The corpus's documents of at most ``max_bytes`` (and ``max_pages`` pages, if given)."""
    from mineru_fast.inputs.documents import open_document

    seeds = {}
    if not corpus.is_dir():
        return seeds
    for path in sorted(corpus.iterdir()):
        if path.suffix == ".md" or path.stat().st_size > max_bytes or "password_required" in path.name:
            continue
        if max_pages is not None:
            with open_document(path, decode_first=False) as opened:
                if opened.page_count > max_pages:
                    continue
        seeds[path.name] = path.read_bytes()
    return seeds


def _flip(data: bytearray, rng: random.Random) -> None:
    for _ in range(rng.randint(1, 16)):
        end = min(len(data), 1024) if rng.random() < 0.7 else len(data)
        data[rng.randrange(end)] ^= 1 << rng.randrange(8)


def _extreme(data: bytearray, rng: random.Random) -> None:
    width = rng.choice((2, 4))
    if len(data) <= width:
        return
    position = rng.randrange(min(len(data), 512) - width + 1)
    value = rng.choice(_EXTREMES) & ((1 << (8 * width)) - 1)
    struct.pack_into(rng.choice("<>") + ("H" if width == 2 else "I"), data, position, value)


def _truncate(data: bytearray, rng: random.Random) -> None:
    del data[rng.randrange(1, len(data)) :]


def _insert(data: bytearray, rng: random.Random) -> None:
    chunk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    position = rng.randrange(len(data) + 1)
    data[position:position] = chunk


def _delete(data: bytearray, rng: random.Random) -> None:
    start = rng.randrange(len(data))
    del data[start : start + rng.randint(1, 256)]


def _duplicate(data: bytearray, rng: random.Random) -> None:
    start = rng.randrange(len(data))
    chunk = data[start : start + rng.randint(1, 512)]
    position = rng.randrange(len(data) + 1)
    data[position:position] = chunk


_MUTATIONS = (_flip, _flip, _extreme, _extreme, _truncate, _insert, _delete, _duplicate)


def mutate(seeds: dict[str, bytes], rng: random.Random) -> tuple[str, bytes]:
    """One mutated input: ``(description, bytes)``; the description names the seed and the steps."""
    name = rng.choice(sorted(seeds))
    data = bytearray(seeds[name])
    steps = []
    if rng.random() < 0.1:  # splice: the head of one seed, the tail of another
        other = rng.choice(sorted(seeds))
        cut = rng.randrange(1, len(data))
        data = data[:cut] + seeds[other][rng.randrange(len(seeds[other])) :]
        steps.append(f"splice:{other}")
    for _ in range(rng.randint(1, 3)):
        if not data:
            break
        mutation = rng.choice(_MUTATIONS)
        mutation(data, rng)
        steps.append(mutation.__name__.lstrip("_"))
    return f"{name} {'+'.join(steps)}", bytes(data)


def check_parse(parser, data: bytes) -> str:
    """Parse ``data``; returns its outcome: the document's status, or the typed input error's name.

    Raises:
        Exception: anything that is not an ``InputError`` (a finding).
    """
    try:
        document = parser.parse(data)
    except InputError as exc:
        return type(exc).__name__
    for page in document.pages:
        assert page.status in ("success", "partial", "failure")
        if page.status == "failure":
            assert page.errors, "a failed page says why"
    return document.status

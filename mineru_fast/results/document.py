"""The parse result: ``Document`` -> ``Page`` -> ``Block``, and its MinerU-format outputs.

Outputs are what official MinerU 4.0.12 writes for the same blocks (see ``writer``): by default its
result bundle (``markdown.md``, ``middle_json.json``, ``structured_content.json``,
``model_output.json`` and ``images/`` crops of image, table, chart and equation blocks); in MinerU
2.x's layout ``<stem>.md``, ``<stem>_content_list.json`` and ``images/``, plus ``<stem>.json``
(everything, including raw outputs, timings, errors, block confidence and the result metadata; it
validates against ``schema/document.schema.json``, see ``metadata``) and a layout overlay PNG per page.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mineru_fast.results.metadata import head_dict
from mineru_fast.results.middle import Envelope
from mineru_fast.results.page import Page, ParseError, Status, status_of
from mineru_fast.results.writer import (
    DocumentWriter,
    PageOutput,
    envelope_for,
    page_summary,
    render_markdown,
    render_page,
    render_pages,
)


@dataclass
class Document:
    """Result of parsing one document.

    Attributes:
        name: source stem, used for output file names.
        status: ``success`` (every page fine), ``partial`` (some pages or blocks failed) or
            ``failure`` (no page could be parsed, or the input could not be opened).
        errors: document-level errors (input errors); page problems are on the pages.
        timings: seconds by stage, summed over pages (``vision``, ``prefill``, ``decode``, ...),
            and ``wall``, the parse's wall-clock seconds.
        counts: the pages' ``counts`` summed.
        metadata: what produced the result (``DocumentParser.result_metadata``: schema version, input
            hash, model and revision, options, package version, tier, runtime choices); None for
            a ``Document`` made by hand (``to_dict`` then writes the schema and package versions).
    """

    name: str
    pages: list[Page] = field(default_factory=list)
    errors: list[ParseError] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    metadata: dict[str, Any] | None = None

    def add_page_totals(self) -> None:
        """Sum the pages' timings and counts into the document's (``wall`` is left as is)."""
        for page in self.pages:
            for key, value in page.timings.items():
                self.timings[key] = self.timings.get(key, 0.0) + value
            for key, count in page.counts.items():
                self.counts[key] = self.counts.get(key, 0) + count

    @property
    def status(self) -> Status:
        return status_of(self.errors, [p.status for p in self.pages])

    def to_markdown(self, image_dir: str = "images") -> str:
        """MinerU 4 Markdown (see ``writer``): headers, footers, page numbers and side notes left
        out, images linked under ``image_dir``; no trailing newline, as mineru writes it."""
        return render_markdown(self.pages, image_dir)

    def to_content_list(self, image_dir: str = "images", *, confidence: bool = False) -> list[dict]:
        """MinerU 4 ``content_list.json`` items (content list V1), in reading order, paratext included.

        Args:
            image_dir: the folder image paths point into.
            confidence: add the ``mf_confidence`` extension field to every item (not in MinerU's
                format; see ``writer.render_page``).
        """
        return [
            item for page in self.pages for item in render_page(page, image_dir, confidence=confidence).content_list
        ]

    def to_dict(self) -> dict:
        """Everything, JSON-serializable (``schema/document.schema.json``): status, metadata, errors,
        timings, counts, pages with raw outputs and block confidence."""
        return {
            **head_dict(self.name, self.status, self.metadata, self.errors, self.timings, self.counts),
            "pages": [p.to_dict() for p in self.pages],
        }

    def _middle(self) -> tuple[Envelope, list[PageOutput]]:
        """The middle JSON's document fields (``writer.envelope_for``) and the rendered pages."""
        outputs = list(render_pages(self.pages))
        head = head_dict(self.name, self.status, self.metadata, self.errors, self.timings, self.counts)
        summaries = [page_summary(page) for page in self.pages]
        rotations = {page.index: output.rotations for page, output in zip(self.pages, outputs, strict=True)}
        modes = {page.ocr_mode for page in self.pages}
        return envelope_for(self.metadata, head, summaries, modes, rotations), outputs

    def to_middle_json(self) -> dict:
        """MinerU 4's middle JSON of the document (what ``save`` writes as ``middle_json.json``;
        see ``middle``): DocVortex's ``docvortex.middle`` 2.0, mineru-fast's record in
        ``extensions["mineru_fast"]``; what continues across pages marked ``continues_prev``."""
        envelope, outputs = self._middle()
        return envelope.middle_json([output.middle for output in outputs])

    def to_structured_content(self) -> dict:
        """MinerU 4's structured content of the document (``structured_content.json``); what
        continues across pages marked ``continues_prev``."""
        envelope, outputs = self._middle()
        return envelope.structured_content([output.structured for output in outputs])

    def save(self, out_dir: str | Path, *, layout: str = "mineru4", confidence: bool = False) -> Path:
        """Write the document into ``out_dir`` page by page (``writer.DocumentWriter``): MinerU 4's
        result bundle (``markdown.md``, ``middle_json.json``, ``structured_content.json``,
        ``model_output.json``, ``images/``), or with ``layout="2.x"`` MinerU 2.x's ``<stem>.md``,
        ``<stem>_content_list.json``, ``<stem>.json``, ``images/`` and ``layout/`` overlays. What an
        earlier save wrote there is removed first, other files are kept.

        Args:
            out_dir: the output directory (created if needed).
            layout: ``"mineru4"`` or ``"2.x"`` (``writer.LAYOUTS``).
            confidence: add the ``mf_confidence`` extension field to the structured-content
                blocks (2.x: the content list items).

        Returns:
            ``out_dir`` as a Path.

        Raises:
            ValueError: an unknown layout.
            OutputError: the folder cannot be written.
        """
        with DocumentWriter(
            out_dir, self.name, layout=layout, release=False, metadata=self.metadata, confidence=confidence
        ) as writer:
            for page in self.pages:
                writer.add_page(page)
            return writer.close(self.errors, self.timings.get("wall"))

    def _repr_markdown_(self) -> str:  # Jupyter renders a Document as its Markdown
        return self.to_markdown()

"""A page's raw content outputs -> its final blocks, by mineru-vl-utils' ``post_process``.

``finish_blocks`` runs the helper MinerU 4.0.12 configures (``protocol.page.vl_helper``): OTSL ->
HTML, equation repair, ``equation_block`` merge, ``[Non-Text]`` cleanup, image-analysis results,
and returns the page's ``Block`` list, the first form of a result.
"""

from __future__ import annotations

from mineru_fast.protocol.page import INDEX_KEY, RAW_TYPE_KEY, ContentOutput, PageLayout, vl_helper
from mineru_fast.results.page import Block

__all__ = ["finish_blocks"]


def finish_blocks(
    layout: PageLayout, outputs: dict[int, ContentOutput], filled: dict[int, str] | None = None
) -> list[Block]:
    """Post-process a page's contents into its final blocks (mineru-vl-utils ``post_process``).

    Tables: OTSL -> HTML, inline math in cells as ``<eq>``. Equations: delimiter, ``\\left``/``\\right``,
    brace and other repairs, then ``\\[ .. \\]``. Text: display math in running text made inline,
    spacing fixes. Two or more equations inside an ``equation_block`` become one
    ``\\begin{array}{l}`` equation (several ``\\tag``s become ``(n)``); ``equation_block`` itself is
    dropped. A block whose whole output is ``[Non-Text]`` is dropped (header / footer kept empty;
    images, tables, equations and containers kept). ``list_item`` becomes ``text``. With image
    analysis an image may become a table, an equation or a chart with a ``sub_type``.

    Args:
        layout: the page's layout after ``plan_content``.
        outputs: ``block_index -> ContentOutput`` for the requests that ran (a failed one included).
        filled: ``block_index -> content`` taken from elsewhere (the standard tier's PDF text):
            set after post-processing, untouched by it, as MinerU 4 fills PDF text after the VLM
            client's post-processing.

    Returns:
        The page's blocks in reading order; ``raw`` / ``finish_reason`` / ``error`` filled for the
        blocks that were read, ``raw_type`` for blocks of an unknown type.
    """
    blocks = layout.blocks
    for index, block in enumerate(blocks):
        block[INDEX_KEY] = index
        output = outputs.get(index)
        if output is not None:
            block.content = output.text if output.finish_reason != "error" else None
    processed = vl_helper().post_process(blocks)
    out = []
    for block in processed:
        index = block.get(INDEX_KEY)
        output = outputs.get(index) if index is not None else None
        x1, y1, x2, y2 = block["bbox"]
        content = block.get("content")
        if filled and index in filled:
            content = filled[index]
        out.append(
            Block(
                type=block["type"],
                bbox=(x1, y1, x2, y2),
                angle=block.get("angle"),
                content=content,
                raw=output.text if output is not None else None,
                finish_reason=output.finish_reason if output is not None else None,
                error=output.error if output is not None and output.finish_reason == "error" else None,
                raw_type=block.get(RAW_TYPE_KEY),
                logprobs=output.logprobs if output is not None else None,
                merge_prev=block.get("merge_prev"),
                sub_type=block.get("sub_type"),
            )
        )
    return out

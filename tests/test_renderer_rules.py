"""Tier 1: the MinerU 4 renderer rules that span blocks and pages (image blocks, full-width
tables, reference lists, tables across pages, index page numbers), pinned with small blocks (no
model, no official package; the official lane compares the same rules with mineru 4.0.12)."""

from __future__ import annotations

import json

from mineru_fast.results.document import Document
from mineru_fast.results.mineru4 import _normalize_table, collapse_image_blocks
from mineru_fast.results.page import Block, Page
from mineru_fast.results.table_merge import can_merge_tables, merge_tables
from mineru_fast.results.writer import DocumentWriter, render_markdown, render_page, strip_index_page_tail

SIZE = (1000, 1000)


def block(kind: str, box: tuple[int, int, int, int], content: str | None = None) -> Block:
    return Block(type=kind, bbox=tuple(v / 1000 for v in box), angle=0, content=content)  # type: ignore[arg-type]


def table_html(*rows: tuple[str, ...]) -> str:
    return "<table>" + "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows) + "</table>"


def test_table_written_anew_is_written_as_beautifulsoup_writes_it():
    """A table whose cell text changes comes back as ``str(BeautifulSoup(markup, "html.parser"))``
    of beautifulsoup4 4.15 (the version official runs): references decoded, attributes sorted and
    quoted, void elements closed, whitespace runs collapsed, misnested tags closed."""
    cases = {
        "<td colspan=2 class=' a  b '>Ａ<br>y &amp; z</td>": '<td class="a b" colspan="2">A<br/>y &amp; z</td>',
        "<td>Ａ it&#x27;s &quot;q&quot; &lt; 5 &foo;</td>": '<td>A it\'s "q" &lt; 5 &amp;foo</td>',  # unknown: ';' lost
        "<td>Ａ<a title='a \"b\"'>q</a><img src=x></img></td>": '<td>A<a title=\'a "b"\'>q</a><img src="x"/></td>',
        "<td>Ａ<div>  \n </div><pre>  </pre><b><i>x</b>y</td>": "<td>A<div>\n</div><pre>  </pre><b><i>x</i></b>y</td>",
        "<td>Ａ<!--c--><script>a<b</script>&#0;</td>": "<td>A<!--c--><script>a<b</script>\ufffd</td>",
    }

    def table(cell: str) -> str:
        return f"<table><tr>{cell}</tr></table>"

    assert {cell: _normalize_table(table(cell)) for cell in cases} == {c: table(w) for c, w in cases.items()}


def test_table_with_full_width_text_is_written_anew_and_others_kept_byte_for_byte():
    changed = (
        "<table><tr><td>Ａ＆Ｂ</td><td>it&#x27;s &quot;q&quot;</td></tr><tr><td colspan=2>１<br>x</td></tr></table>"
    )
    assert _normalize_table(changed) == (
        '<table><tr><td>A&amp;B</td><td>it\'s "q"</td></tr><tr><td colspan="2">1<br/>x</td></tr></table>'
    )
    formula_only = "<table><tr><td><eq>Ｘ_1</eq></td><td>it&#x27;s</td></tr></table>"
    assert _normalize_table(formula_only) == formula_only  # nothing visible changed: markup kept


def test_image_block_collapses_into_one_image_and_drops_what_lies_inside():
    model = [
        {"type": "image_block", "bbox": [0.1, 0.05, 0.9, 0.45]},
        {"type": "image", "bbox": [0.12, 0.06, 0.48, 0.38]},
        {"type": "text", "bbox": [0.52, 0.2, 0.88, 0.22]},
        {"type": "aside_text", "bbox": [0.85, 0.3, 0.99, 0.6]},  # half inside: kept
        {"type": "caption", "bbox": [0.1, 0.46, 0.9, 0.48]},
    ]
    assert [(b["type"], b["bbox"]) for b in collapse_image_blocks(model)] == [
        ("image", [0.1, 0.05, 0.9, 0.45]),
        ("aside_text", [0.85, 0.3, 0.99, 0.6]),
        ("caption", [0.1, 0.46, 0.9, 0.48]),
    ]


def test_image_block_caption_attaches_to_the_collapsed_image_and_names_follow_it():
    blocks = [
        block("image_block", (100, 50, 900, 450)),
        block("image", (120, 60, 480, 380)),
        block("image", (520, 60, 880, 380)),
        block("image_caption", (100, 460, 900, 480), "Figure 2"),
        block("image", (100, 560, 500, 800)),
    ]
    output = render_page(Page(0, SIZE, blocks))
    assert output.markdown == "![](images/page_0_image_0.jpg)\n\nFigure 2\n\n![](images/page_0_image_2.jpg)"
    assert output.content_list[0]["image_caption"] == ["Figure 2"]


def reference_page(index: int, *items: str, top: int = 100) -> Page:
    children = [block("ref_text", (100, top + 50 * i, 900, top + 40 + 50 * i), text) for i, text in enumerate(items)]
    container = block("list", (100, top, 900, top + 50 * len(items)))
    return Page(index, SIZE, [container, *children])


def test_reference_lists_join_on_a_page_and_across_a_break_with_furniture_between():
    first = reference_page(0, "[1] One.", "[2] Two.")
    first.blocks += [reference_page(0, "[3] Three.", top=400).blocks[i] for i in (0, 1)]
    first.blocks.append(block("page_number", (450, 970, 550, 990), "7"))
    second = reference_page(1, "[4] Four.", top=200)
    second.blocks.insert(0, block("header", (100, 20, 900, 40), "Running head"))
    second.blocks.append(block("text", (100, 800, 900, 840), "After."))
    assert render_markdown([first, second]) == "[1] One.\n[2] Two.\n[3] Three.\n[4] Four.\n\nAfter."
    # The content list keeps one item per list, as official's does.
    assert [len(i["list_items"]) for i in render_page(first).content_list if i["type"] == "list"] == [2, 1]


def test_reference_lists_do_not_join_across_text_or_a_skipped_page():
    page = reference_page(0, "[1] One.")
    page.blocks.append(block("text", (100, 300, 900, 340), "Between."))
    page.blocks += reference_page(0, "[2] Two.", top=400).blocks
    assert render_page(page).markdown == "[1] One.\n\nBetween.\n\n[2] Two."
    assert render_markdown([reference_page(0, "[1] One."), reference_page(2, "[2] Two.")]) == "[1] One.\n\n[2] Two."


def test_reference_items_are_numbered_when_a_digit_is_among_their_first_five_characters():
    numbered = reference_page(0, "1 Smith.", "【2】 Doe.", "3、 Li.")
    assert render_page(numbered).markdown == "1 Smith.\n【2】 Doe.\n3、 Li."
    plain = reference_page(0, "Smith.", "- Doe.", "[1] Li.")
    assert render_page(plain).markdown == "- Smith.\n- Doe.\n- [1] Li."


def table_page(index: int, html: str, *, top: bool) -> Page:
    box = (100, 50, 900, 400) if top else (100, 600, 900, 950)
    return Page(index, SIZE, [block("table", box, html)])


def test_table_split_across_pages_is_one_table_in_markdown_and_two_in_the_content_list(tmp_path):
    pages = [
        table_page(0, table_html(("name", "value"), ("a", "1")), top=False),
        table_page(1, table_html(("name", "value"), ("b", "2")), top=True),
        table_page(2, table_html(("b", "2")), top=True),
    ]
    expected = "| name | value |\n| --- | --- |\n| a | 1 |\n| b | 2 |\n| b | 2 |"
    assert render_markdown(pages) == expected
    with DocumentWriter(tmp_path / "2.x", "doc", layout="2.x", overlays=False) as writer:
        for page in pages:
            writer.add_page(page)
    assert (tmp_path / "2.x" / "doc.md").read_text(encoding="utf-8") == expected
    assert len(json.loads((tmp_path / "2.x" / "doc_content_list.json").read_text(encoding="utf-8"))) == 3
    with DocumentWriter(tmp_path / "bundle", "doc") as writer:  # MinerU 4's bundle, the default
        for page in pages:
            writer.add_page(page)
    assert (tmp_path / "bundle" / "markdown.md").read_text(encoding="utf-8") == expected
    middle = json.loads((tmp_path / "bundle" / "middle_json.json").read_text(encoding="utf-8"))
    marks = [[block.get("continues_prev") for block in page["blocks"]] for page in middle["pages"]]
    assert marks == [[None], [True], [True]]  # the tables of pages 1 and 2 continue the one before
    document = Document("doc", pages)
    assert document.to_markdown() == expected
    assert document.to_middle_json()["pages"] == middle["pages"]


def test_tables_with_column_spans_join_when_the_boundary_rows_line_up():
    span = '<td colspan="2">'
    previous = f"<table><tr><td>p</td><td>q</td><td>r</td></tr><tr>{span}1</td><td>3</td></tr></table>"
    lined_up = f"<table><tr>{span}4</td><td>6</td></tr></table>"
    offset = "<table><tr><td>4</td><td>5</td><td>6</td></tr></table>"
    joined = render_markdown([table_page(0, previous, top=False), table_page(1, lined_up, top=True)])
    assert joined == previous.replace("</table>", f"<tr>{span}4</td><td>6</td></tr></table>")
    apart = render_markdown([table_page(0, previous, top=False), table_page(1, offset, top=True)])
    assert apart == f"{previous}\n\n| 4 | 5 | 6 |\n| --- | --- | --- |"


def test_tables_of_other_widths_or_columns_or_with_a_new_caption_stay_apart():
    previous = render_page(table_page(0, table_html(("a", "1")), top=False)).pieces[0].block
    narrow = render_page(Page(1, SIZE, [block("table", (100, 50, 500, 400), table_html(("b", "2")))])).pieces[0].block
    wider = render_page(table_page(1, table_html(("b", "2", "3")), top=True)).pieces[0].block
    captioned = Page(
        1, SIZE, [block("table_caption", (100, 20, 900, 40), "Table 2"), *table_page(1, "", top=True).blocks]
    )
    captioned.blocks[1].content = table_html(("b", "2"))
    new_table = render_page(captioned).pieces[0].block
    assert not can_merge_tables(narrow, previous) and not can_merge_tables(wider, previous)
    assert not can_merge_tables(new_table, previous) and merge_tables(previous, new_table) is None
    continued = {**new_table, "content": [dict(c) for c in new_table["content"]]}
    continued["content"][0]["content"] = [{"type": "text", "content": "Table 1 (continued)"}]
    assert can_merge_tables(continued, previous)


def test_index_entry_loses_its_page_number_after_the_last_tab():
    def spans(text: str) -> list[dict]:
        return [{"type": "text", "content": text}]

    assert strip_index_page_tail(spans("Intro\t12")) == spans("Intro")
    assert strip_index_page_tail(spans("Methods\tand more\tiv")) == spans("Methods and more")
    assert strip_index_page_tail(spans("Appendix\tnot a page")) == spans("Appendix not a page")
    with_math = [{"type": "text", "content": "Proof of "}, {"type": "equation_inline", "content": "x"}]
    assert strip_index_page_tail([*with_math, {"type": "text", "content": "\tB"}]) == with_math

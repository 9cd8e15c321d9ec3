"""Tier 1: OTSL -> HTML, equation cleanup, content post-processing."""

from __future__ import annotations

from mineru_fast.postprocess import clean_equation, otsl_to_html, postprocess_content
from mineru_fast.traces import html_table_cells, html_to_otsl


def test_otsl_spans_become_rowspan_and_colspan():
    otsl = "<fcel>Head<lcel><lcel><nl><fcel>a<fcel>b<fcel>c<nl><fcel>tall<fcel>x<fcel>y<nl><ucel><fcel>z<ecel><nl>"
    assert otsl_to_html(otsl) == (
        '<table><tr><td colspan="3">Head</td></tr>'
        "<tr><td>a</td><td>b</td><td>c</td></tr>"
        '<tr><td rowspan="2">tall</td><td>x</td><td>y</td></tr>'
        "<tr><td>z</td><td></td></tr></table>"
    )


def test_otsl_block_span_with_xcel():
    otsl = "<fcel>big<lcel><fcel>r<nl><ucel><xcel><fcel>s<nl>"
    assert (
        otsl_to_html(otsl)
        == '<table><tr><td rowspan="2" colspan="2">big</td><td>r</td></tr><tr><td>s</td></tr></table>'
    )


def test_otsl_ragged_rows_are_padded_and_text_escaped():
    html = otsl_to_html("<fcel>a<b & c><nl><fcel>1<fcel>2<fcel>3<nl>")
    assert html == (
        "<table><tr><td>a&lt;b &amp; c&gt;</td><td></td><td></td></tr><tr><td>1</td><td>2</td><td>3</td></tr></table>"
    )


def test_otsl_orphan_merge_tokens_become_empty_cells():
    assert otsl_to_html("<lcel><fcel>x<nl><ucel><ucel><nl>") == (
        '<table><tr><td rowspan="2"></td><td rowspan="2">x</td></tr><tr></tr></table>'
    )
    assert otsl_to_html("no cells at all") == "<table></table>"


def test_html_to_otsl_round_trips_cell_structure():
    html = (
        '<table><tr><th rowspan="2">k</th><th colspan="3">% Recovery</th></tr>'
        "<tr><td>s1</td><td>s2</td><td>s3</td></tr>"
        '<tr><td colspan="2" rowspan="2">blk</td><td>u</td><td>v</td></tr>'
        "<tr><td>w</td><td></td></tr></table>"
    )
    otsl = html_to_otsl(html)
    assert otsl == (
        "<fcel>k<fcel>% Recovery<lcel><lcel><nl>"
        "<ucel><fcel>s1<fcel>s2<fcel>s3<nl>"
        "<fcel>blk<lcel><fcel>u<fcel>v<nl>"
        "<ucel><xcel><fcel>w<ecel><nl>"
    )
    assert html_table_cells(otsl_to_html(otsl)) == html_table_cells(html)


def test_clean_equation_strips_delimiters_and_balances():
    assert clean_equation("\\[\nE = mc^2\n\\]") == "E = mc^2"
    assert clean_equation("$$ a + b $$") == "a + b"
    assert clean_equation("\\frac{a}{b") == "\\frac{a}{b}"
    assert clean_equation("a}+b") == "a+b"
    assert clean_equation("\\left( x \\\\") == "\\left( x \\right."
    assert clean_equation("x \\right)") == "\\left. x \\right)"
    assert clean_equation("\\{ a \\}") == "\\{ a \\}"  # escaped braces are not counted


def test_postprocess_content_by_type():
    assert postprocess_content("table", "<fcel>1<nl>") == "<table><tr><td>1</td></tr></table>"
    assert postprocess_content("table", " <table><tr><td>x</td></tr></table>") == "<table><tr><td>x</td></tr></table>"
    assert postprocess_content("equation", "\\[x\\]") == "x"
    assert postprocess_content("text", "  hello \n") == "hello"

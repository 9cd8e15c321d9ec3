"""``mineru-fast parse`` progress lines on stderr: one line per report, whatever the file names."""

from __future__ import annotations

import pytest
from samples import sample_trace, text_page

from mineru_fast.cli.main import main


@pytest.mark.slow
def test_a_file_name_with_a_newline_keeps_each_progress_report_on_one_line(tiny_model, tmp_path, capsys):
    """A name holding a newline split a progress line in two (the second half looked like a line
    of its own)."""
    image = tmp_path / "two\nlines.png"
    text_page(size=(400, 300)).save(image, format="PNG")
    trace = tmp_path / "trace.json"
    sample_trace(1).save(trace)
    args = ["parse", str(image), "-o", str(tmp_path / "out"), "--model", str(tiny_model), "--replay", str(trace)]
    assert main([*args, "--preset", "exact", "--progress", "lines"]) == 0
    captured = capsys.readouterr()
    err, out = captured.err.splitlines(), captured.out.splitlines()
    assert err and all(line.startswith("mineru-fast: ") for line in err), err
    assert [line.split(" (")[0] for line in err] == ["mineru-fast: two\\nlines.png: page 1 success"]
    assert len(out) == 1 and "two\\nlines.png: success, 1 page(s) -> " in out[0], out  # the summary too

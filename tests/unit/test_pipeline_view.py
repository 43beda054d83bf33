"""Schedule drawings: the text grid (rows, cells, bubble figures) and the PNG."""

import sys

import pytest

from lightning_5d.parallel.pipeline.actions import ActionCosts, action_lists, simulate
from lightning_5d.pipeline_view import render_png, render_text

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def rank_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("rank ")]


def test_text_has_a_row_per_rank_and_both_bubble_figures():
    text = render_text(simulate(action_lists("1f1b", 4, 8, 1)), "1f1b")
    rows = rank_rows(text)
    assert len(rows) == 4
    assert len({len(row) for row in rows}) == 1
    assert "bubble, simulated (idle / (ranks x makespan)): 27.27%" in text
    assert "bubble, formula (1F1B (p-1)/(m+p-1)): 27.27%" in text
    assert "peak microbatches in flight on stage 0: 4" in text


def test_text_cells_are_kind_and_microbatch_with_dots_for_idle():
    rows = rank_rows(render_text(simulate(action_lists("afab", 2, 2, 1)), "afab"))
    assert rows == [
        "rank 0 (stage 0) F0F1......B0B0B1B1",
        "rank 1 (stage 1) ..F0F1B0B0B1B1....",
    ]


def test_second_chunk_is_lower_case_and_split_backward_shows_i_and_w():
    text = render_text(simulate(action_lists("zbv", 2, 4, 2)), "zbv")
    rows = rank_rows(text)
    assert rows[0].startswith("rank 0 (stage 0,3) F0F1F2f0i0w0")
    assert "I input-grad backward" in text and "W weight-grad backward" in text
    assert "ZB-V (p-1)/(6m+p-1)" in text


def test_fractional_costs_use_a_finer_column():
    timeline = simulate(action_lists("1f1b", 2, 4, 1), ActionCosts(0.5, 1, 1))
    text = render_text(timeline, "1f1b")
    assert "one column = 0.5 time units" in text
    assert all(len(row.split(") ", 1)[1]) == 2 * timeline.makespan / 0.5 for row in rank_rows(text))


def test_png_is_written_and_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "interleaved.png"
    written = render_png(simulate(action_lists("interleaved_1f1b", 2, 4, 2)), path, "interleaved", "interleaved_1f1b")
    assert written == str(path)
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert path.stat().st_size > 5_000


def test_png_without_matplotlib_names_the_plot_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"lightning_5d\[plot\]"):
        render_png(simulate(action_lists("1f1b", 2, 2, 1)), tmp_path / "x.png", "x")

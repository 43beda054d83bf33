"""End to end: ``l5d train -m recipe=sweep_tiny`` writes one comparison table of its layouts.

A small grid: two layouts that train on 2 processes and one that cannot (tp*pp = 4 ranks), which
``l5d train`` refuses before starting any worker. The table still has all three rows, and Hydra
still ends the sweep with exit code 1 for the refused job.
"""

from __future__ import annotations

import json

import pytest
from test_cli import l5d  # the same clean environment as every other l5d run


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_sweep_writes_one_table_with_the_planner_mark(tmp_path):
    sweep = tmp_path / "sweep"
    proc = l5d(
        "train", "-m", "recipe=sweep_tiny", "layout=ddp,tp2_sp,tp2_pp2", "devices=2", "trainer.max_steps=3",
        f"hydra.sweep.dir={sweep}", cwd=tmp_path, timeout=570,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]  # the refused job
    table = (sweep / "sweep.md").read_text()
    assert "[l5d] sweep table" in proc.stdout and table in proc.stdout
    rows = {row["label"]: row for row in json.loads((sweep / "sweep.json").read_text())["rows"]}
    assert set(rows) == {"layout=ddp", "layout=tp2_sp", "layout=tp2_pp2"}
    for label in ("layout=ddp", "layout=tp2_sp"):
        assert rows[label]["status"] == "ok" and rows[label]["tokens_per_s"] > 0 and rows[label]["steps"] == 3
    assert rows["layout=tp2_pp2"]["status"] == "refused" and "LayoutError" in rows["layout=tp2_pp2"]["error"]
    # On 2 ranks the planner ranks plain data parallelism (dp=2, zero 0) first: the ddp row.
    assert rows["layout=ddp"]["plan_choice"] and not rows["layout=tp2_sp"]["plan_choice"]
    assert "Planner's top choice (`l5d plan` for tiny on 2 ranks" in table and "job 0 (layout=ddp)" in table

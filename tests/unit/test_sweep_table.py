"""The sweep table from synthetic job directories: ranking, the planner's mark, jobs that did not finish."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra.core.utils import JobStatus
from hydra.types import RunMode
from omegaconf import OmegaConf

from lightning_5d.sweep_table import (
    PLAN_MARK,
    SweepTable,
    build,
    expected_jobs,
    format_markdown,
    layout_key,
    write,
)
from lightning_5d.train import compose


def fake_job(sweep: Path, num: int, layout: str, tokens_per_s=None, error=None, launched=False) -> Path:
    """A job directory as `l5d train -m recipe=sweep_tiny` leaves it (Hydra's records, summary or error)."""
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    overrides = ["recipe=sweep_tiny", f"layout={layout}"]
    OmegaConf.save(compose(overrides), job / ".hydra" / "config.yaml")
    hydra = {"job": {"num": num}, "overrides": {"task": overrides}, "runtime": {"choices": {"model": "tiny"}}}
    OmegaConf.save(OmegaConf.create({"hydra": hydra}), job / ".hydra" / "hydra.yaml")
    if launched:
        (job / "resolved.yaml").write_text("{}\n")
    if tokens_per_s is not None:
        memory = [{"rank": r, "peak_accel": 0} for r in range(4)]
        summary = {"loss": 4.5, "tokens_per_s": tokens_per_s, "steps": 8, "model_state_mib_max": 6.5,
                   "peak_rss_mib_max": 440.0, "memory": memory}  # fmt: skip
        (job / "summary.json").write_text(json.dumps(summary))
    if error is not None:
        (job / "error.txt").write_text(error)
    return job


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    fake_job(root, 0, "ddp", tokens_per_s=1000.0)
    fake_job(root, 1, "zero1", tokens_per_s=3000.0)
    fake_job(root, 2, "tp2_sp", tokens_per_s=2000.0)
    fake_job(root, 3, "tp2_pp2", error="LayoutError: world size 4 is not divisible by 8")
    fake_job(root, 4, "cp2", error="WorkersFailed: workers exited with code 1", launched=True)
    return build(root)


def test_rows_ranked_by_measured_tokens_per_s_jobs_that_did_not_finish_last(sweep):
    assert [r.label for r in sweep.rows] == [
        "layout=zero1", "layout=tp2_sp", "layout=ddp", "layout=tp2_pp2", "layout=cp2",
    ]  # fmt: skip
    assert [r.status for r in sweep.rows] == ["ok", "ok", "ok", "refused", "failed"]
    tp = sweep.rows[1]
    assert (tp.sizes["tp"], tp.sizes["dp_shard"], tp.sp, tp.zero) == (2, 2, True, 1)
    md = format_markdown(sweep)
    body = [line for line in md.splitlines() if line.startswith("| ")][1:]
    assert [line.split(" | ")[0] for line in body] == ["| 1", "| 2", "| 3", "| -", "| -"]
    assert "refused: LayoutError: world size 4 is not divisible by 8" in body[3]
    assert "failed: WorkersFailed" in body[4]


def test_planner_choice_is_marked_and_named_under_the_table(sweep):
    # tiny on 4 ranks with a global batch of 16: the planner ranks plain DP (zero 0) first.
    marked = [r for r in sweep.rows if r.plan_choice]
    assert [r.label for r in marked] == ["layout=ddp"] and marked[0].plan_rank == 1
    assert all(r.predicted_tokens_per_s for r in sweep.rows[:3])
    md = format_markdown(sweep)
    assert sum(PLAN_MARK in line for line in md.splitlines()) == 1
    assert "Planner's top choice (`l5d plan` for tiny on 4 ranks" in md
    assert "job 0 (layout=ddp), measured #3 of 3" in md


def test_planner_choice_outside_the_grid_is_named(tmp_path):
    fake_job(tmp_path, 0, "zero3", tokens_per_s=900.0)
    md = write(build(tmp_path))
    assert PLAN_MARK not in md
    assert "dp=4 zero=0" in md and "not in this grid" in md
    assert (tmp_path / "sweep.md").read_text() == md
    assert json.loads((tmp_path / "sweep.json").read_text())["rows"][0]["status"] == "ok"


def test_layout_key_drops_settings_without_effect():
    sizes = dict(dp_replicate=4, dp_shard=1, tp=1, cp=1, pp=1, ep=1)
    # ZeRO shards over dp_shard x cp; sp needs tp; a schedule needs pp.
    assert layout_key(sizes, 1, True, "interleaved_1f1b", 2) == layout_key(sizes, 0, False, "1f1b", 1)
    assert layout_key({**sizes, "dp_replicate": 1, "dp_shard": 4}, 1, False, None, 1) != layout_key(
        {**sizes, "dp_replicate": 1, "dp_shard": 4}, 3, False, None, 1
    )


def test_job_count_follows_the_sweeper_params_and_the_command_line():
    def multirun(task):
        sweeper = {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper",
                   "params": {"layout": "ddp,zero1,tp2_sp"}}  # fmt: skip
        return OmegaConf.create({"hydra": {"sweeper": sweeper, "overrides": {"task": task}}})

    assert expected_jobs(multirun(["recipe=sweep_tiny"])) == 3
    assert expected_jobs(multirun(["layout=ddp,cp2", "devices=2,4"])) == 4  # the command line replaces params


def test_callback_records_a_failed_job_and_writes_the_table_after_the_last(tmp_path, capsys):
    fake_job(tmp_path, 0, "zero1", tokens_per_s=1000.0)
    refused = fake_job(tmp_path, 1, "tp2_pp2")
    callback = SweepTable()
    callback._expected = 2

    def end(job_dir, status, value=None):
        hydra = {"mode": RunMode.MULTIRUN, "runtime": {"output_dir": str(job_dir)}, "sweep": {"dir": str(tmp_path)}}
        ret = SimpleNamespace(status=status, _return_value=value)
        callback.on_job_end(OmegaConf.create({"hydra": hydra}), job_return=ret)

    end(tmp_path / "0", JobStatus.COMPLETED)
    assert not (tmp_path / "sweep.md").exists()
    end(refused, JobStatus.FAILED, ValueError("tp*pp=4 does not divide 2"))
    assert (refused / "error.txt").read_text() == "ValueError: tp*pp=4 does not divide 2\n"
    assert "refused: ValueError" in (tmp_path / "sweep.md").read_text()
    assert "[l5d] sweep table" in capsys.readouterr().out
    callback.on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    assert "[l5d] sweep table" not in capsys.readouterr().out  # written once


def test_every_layout_of_the_sweep_recipe_passes_the_launch_checks():
    from lightning_5d.train import validate

    grid = compose(["recipe=sweep_tiny"], return_hydra_config=True).hydra.sweeper.params.layout.split(",")
    assert sorted(grid) == sorted(p.stem for p in (Path(__file__).parents[2] / "conf" / "layout").glob("*.yaml"))
    for layout in grid:
        assert validate(compose(["recipe=sweep_tiny", f"layout={layout}"])).world_size == 4

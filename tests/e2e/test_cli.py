"""End to end: the ``l5d`` command as a user runs it.

Training runs are subprocesses with hard timeouts (``timeout=`` on the subprocess and
``pytest.mark.timeout`` on the test), so a hang fails the test instead of the suite.
Hydra's output directories point into ``tmp_path``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
PARALLEL_OPTIONS = sorted(p.stem for p in (ROOT / "conf" / "parallel").glob("*.yaml"))
TORCHELASTIC_VARS = ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def l5d(*args: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in TORCHELASTIC_VARS
    }  # a test run inside srun/torchrun must still start its own workers
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, "-m", "lightning_5d.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def summary_line(stdout: str) -> dict[str, str]:
    lines = [line for line in stdout.splitlines() if line.startswith("SUMMARY ")]
    assert len(lines) == 1, stdout[-4000:]
    return dict(item.split("=", 1) for item in lines[0].split()[1:])


def check_summary(run_dir: Path, steps: int, world: int, zero: int, data_ranks: int | None = None) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps
    assert summary["world_size"] == world
    assert summary["zero"] == zero
    assert math.isfinite(summary["loss"]) and 0 < summary["loss"] < 10
    assert summary["tokens_per_s"] > 0
    assert summary["tokens_per_step"] == 4 * 128 * (data_ranks or world)  # batch 4 x seq 128 per data rank
    assert [row["rank"] for row in summary["memory"]] == list(range(world))
    for row in summary["memory"]:
        assert row["params"] > 0 and row["peak_rss"] > 0
    assert (run_dir / "resolved.yaml").is_file()
    return summary


# ------------------------------------------------------------------ fast, in-process


def test_help_lists_commands(capsys):
    from lightning_5d.cli import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("train", "estimate", "plan"):
        assert command in out


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_composes_and_validates(recipe):
    from lightning_5d.train import compose, validate

    cfg = compose([f"recipe={recipe}"])
    layout = validate(cfg)
    assert layout.world_size == cfg.devices * cfg.num_nodes


def test_default_recipe_is_tiny_tp():
    from lightning_5d.train import compose, validate

    cfg = compose([], return_hydra_config=True)
    assert cfg.hydra.runtime.choices.recipe == "tiny_tp"
    layout = validate(cfg)
    assert (layout.dp_shard, layout.tp, int(cfg.parallel.zero), cfg.devices) == (2, 2, 1, 4)
    assert cfg.parallel.sequence_parallel is True


def test_tp_that_does_not_fit_the_heads_fails_before_launch():
    from lightning_5d.parallel.tensor.validate import TensorParallelError
    from lightning_5d.train import compose, validate

    with pytest.raises(TensorParallelError, match="tp=8 exceeds the 4 key/value heads"):
        validate(compose(["parallel.tp=8", "devices=8"]))


def test_sequence_that_cp_cannot_cut_fails_before_launch():
    from lightning_5d.parallel.context.routing import ContextParallelError
    from lightning_5d.train import compose, validate

    assert validate(compose(["recipe=tiny_cp"])).cp == 2
    with pytest.raises(ContextParallelError, match=r"sequence length 510 is not divisible by 2\*cp=4"):
        validate(compose(["recipe=tiny_cp", "data.seq_len=510"]))


def test_command_line_beats_recipe():
    from lightning_5d.train import compose

    cfg = compose(["recipe=tiny_zero3", "parallel=zero1", "devices=2"])
    assert (int(cfg.parallel.zero), cfg.devices) == (1, 2)


@pytest.mark.parametrize("option", PARALLEL_OPTIONS)
def test_parallel_group_keys_are_parallel_config_fields(option):
    from lightning_5d.config import ParallelConfig
    from lightning_5d.train import compose

    cfg = compose([f"parallel={option}"])
    assert set(cfg.parallel) == {f.name for f in dataclasses.fields(ParallelConfig)}
    ParallelConfig.from_mapping(dict(cfg.parallel))


# ------------------------------------------------------------------ subprocesses


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_train_short_run(tmp_path):
    run_dir = tmp_path / "run"
    proc = l5d("train", "trainer.max_steps=3", "devices=2", f"hydra.run.dir={run_dir}", cwd=tmp_path, timeout=270)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    line = summary_line(proc.stdout)
    assert line["steps"] == "3" and line["world_size"] == "2" and line["zero"] == "1"
    assert line["layout"] == "tp:2" and line["recipe"] == "tiny_tp"
    assert math.isfinite(float(line["loss"])) and float(line["peak_rss_mib_max"]) > 0
    summary = check_summary(run_dir, steps=3, world=2, zero=1, data_ranks=1)  # tp=2: one data rank
    assert float(line["loss"]) == pytest.approx(summary["loss"], rel=1e-3)
    assert (run_dir / "workers.log").is_file()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.dp_shard=3", "devices=4"], "does not match the world size 4"),
        (["parallel.tp=3", "devices=4"], "world size 4 is not divisible"),
    ],
)
def test_bad_layout_fails_before_any_worker(tmp_path, overrides, message):
    run_dir = tmp_path / "run"
    proc = l5d("train", *overrides, f"hydra.run.dir={run_dir}", cwd=tmp_path, timeout=100)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    # Nothing was launched: no resolved config, no worker output, no process group.
    assert not (run_dir / "resolved.yaml").exists()
    assert not (run_dir / "workers.log").exists()
    assert "Initializing distributed" not in proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_multirun_each_job_has_its_summary(tmp_path):
    sweep = tmp_path / "sweep"
    proc = l5d(
        "train", "-m", "parallel=zero0,zero3", "devices=2", "trainer.max_steps=3",
        f"hydra.sweep.dir={sweep}", cwd=tmp_path, timeout=570,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = [summary_line(block) for block in re.split(r"(?=SUMMARY )", proc.stdout) if "SUMMARY " in block]
    assert [line["zero"] for line in lines] == ["0", "3"]
    zero0 = check_summary(sweep / "0", steps=3, world=2, zero=0)
    zero3 = check_summary(sweep / "1", steps=3, world=2, zero=3)
    # Same data and initial weights: ZeRO changes where state lives, not the numbers.
    assert zero3["loss"] == pytest.approx(zero0["loss"], rel=1e-4)
    assert zero3["model_state_mib_max"] < zero0["model_state_mib_max"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_cp_recipe_trains_and_validates(tmp_path):
    run_dir = tmp_path / "run"
    proc = l5d(
        "train", "recipe=tiny_cp", "devices=2", "trainer.max_steps=4", "trainer.limit_val_batches=2",
        "+trainer.val_check_interval=2", f"hydra.run.dir={run_dir}", cwd=tmp_path, timeout=270,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    line = summary_line(proc.stdout)
    assert line["layout"] == "cp:2" and line["recipe"] == "tiny_cp" and math.isfinite(float(line["loss"]))
    check_summary(run_dir, steps=4, world=2, zero=1, data_ranks=1)  # cp=2: one data rank


def test_schedule_draws_the_pipeline_and_its_bubble(capsys, tmp_path):
    from lightning_5d.cli import main

    assert main(["--help"]) == 0
    assert "schedule" in capsys.readouterr().out
    png = tmp_path / "1f1b.png"
    args = ["schedule", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8"]
    assert main(args + (["--png", str(png)] if _has_matplotlib() else [])) == 0
    out = capsys.readouterr().out
    assert len([line for line in out.splitlines() if line.startswith("rank ")]) == 4
    assert "bubble, simulated (idle / (ranks x makespan)): 27.27%" in out
    assert "bubble, formula (1F1B (p-1)/(m+p-1)): 27.27%" in out
    if _has_matplotlib():
        assert png.read_bytes()[:4] == b"\x89PNG"


def test_schedule_bad_input_exits_2_with_the_layout_message(capsys):
    from lightning_5d.cli import main

    assert main(["schedule", "--schedule", "zbv", "--pp", "4", "--virtual-stages", "1"]) == 2
    err = capsys.readouterr().err
    assert "exactly 2 stages per rank" in err
    assert "Traceback" not in err


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True

"""End to end: every CPU recipe in recipes/ trains as ``l5d train recipe=NAME`` (2 steps).

CPU recipes are those on the cpu trainer; the production-shaped GPU/SLURM recipes cannot run
here and are checked by the planner instead (tests/unit/estimate/test_production_recipes.py).
"""

from __future__ import annotations

import json
import math

import pytest

from test_cli import RECIPES, l5d, summary_line

STEPS = 2


def _on_cpu(recipe: str) -> bool:
    from lightning_5d.train import compose

    return compose([f"recipe={recipe}"], return_hydra_config=True).hydra.runtime.choices.trainer == "cpu"


CPU_RECIPES = [r for r in RECIPES if _on_cpu(r)]
# Trained end to end by their own tests already (same command, more checks): not again here.
TRAINED_ELSEWHERE = {
    "tiny_tp": "test_cli.py::test_train_short_run",
    "tiny_cp": "test_cli.py::test_cp_recipe_trains_and_validates",
    "tiny_moe": "test_cli_expert.py",
    "tiny_fp8": "test_cli_precision.py",
    "sweep_tiny": "test_cli_sweep.py",
}


def test_recipe_library_has_each_dimension_alone_and_all_five():
    wanted = {"tiny_dp", "tiny_zero3", "tiny_tp", "tiny_cp", "tiny_pp", "tiny_moe", "tiny_5d", "tiny_5d_moe"}
    assert wanted <= set(CPU_RECIPES), sorted(wanted - set(CPU_RECIPES))
    for recipe, test in TRAINED_ELSEWHERE.items():
        assert recipe in CPU_RECIPES and recipe in _source_of(test), (recipe, test)


def _source_of(test: str) -> str:
    from pathlib import Path

    return (Path(__file__).parent / test.split("::")[0]).read_text()


@pytest.mark.extended
@pytest.mark.distributed
@pytest.mark.timeout(420)
@pytest.mark.parametrize("recipe", [r for r in CPU_RECIPES if r not in TRAINED_ELSEWHERE])
def test_cpu_recipe_trains(tmp_path, recipe):
    from lightning_5d.train import compose, validate

    layout = validate(compose([f"recipe={recipe}"]))
    run_dir = tmp_path / "run"
    proc = l5d(
        "train", f"recipe={recipe}", f"trainer.max_steps={STEPS}", "trainer.log_every=1", f"hydra.run.dir={run_dir}",
        cwd=tmp_path, timeout=390,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    line = summary_line(proc.stdout)
    assert line["recipe"] == recipe and int(line["world_size"]) == layout.world_size
    assert math.isfinite(float(line["loss"]))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and len(summary["memory"]) == layout.world_size

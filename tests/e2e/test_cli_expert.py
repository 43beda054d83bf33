"""End to end: ``l5d train recipe=tiny_moe`` trains with expert parallelism and logs the expert load.

The recipe turns Lightning's logger on; without TensorBoard installed that is a
``CSVLogger`` writing ``<run dir>/lightning_logs/version_0/metrics.csv`` (with it, event
files, which this test does not read: it is skipped then).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
from test_cli import l5d  # the same clean environment as every other l5d run

STEPS = 3


def _tensorboard_installed() -> bool:
    from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import (
        _TENSORBOARD_AVAILABLE,
        _TENSORBOARDX_AVAILABLE,
    )

    return bool(_TENSORBOARD_AVAILABLE or _TENSORBOARDX_AVAILABLE)


def metric_rows(run_dir: Path) -> list[dict[str, str]]:
    files = sorted(run_dir.glob("lightning_logs/version_*/metrics.csv"))
    assert len(files) == 1, f"expected one metrics.csv under {run_dir}, found {files}"
    with files[0].open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_moe_recipe_trains_and_logs_expert_load(tmp_path):
    if _tensorboard_installed():
        pytest.skip("Lightning's default logger is TensorBoard here; this test reads the CSV logger's file")
    run_dir = tmp_path / "run"
    proc = l5d("train", "recipe=tiny_moe", f"trainer.max_steps={STEPS}", f"hydra.run.dir={run_dir}",
               cwd=tmp_path, timeout=270)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = [line for line in proc.stdout.splitlines() if line.startswith("SUMMARY ")]
    assert len(summary) == 1, proc.stdout[-4000:]
    fields = dict(item.split("=", 1) for item in summary[0].split()[1:])
    assert fields["recipe"] == "tiny_moe" and fields["layout"] == "dp_shard:2,ep:2" and fields["steps"] == str(STEPS)
    assert math.isfinite(float(fields["loss"]))

    rows = metric_rows(run_dir)
    assert len(rows) == STEPS  # log_every_n_steps=1: one row per optimizer step
    experts = [f"moe/expert_{e}_tokens" for e in range(4)]
    for name in ("moe/load_imbalance", "moe/dropped_tokens", "moe/aux_loss", *experts):
        assert name in rows[0], f"{name} not logged; columns: {sorted(rows[0])}"
    # Every step routes each rank's 4 x 128 tokens to 2 experts in each of the 4 MoE layers.
    assignments = 2 * 4 * 128 * 2 * 4  # ranks x batch x seq x top_k x layers
    for row in rows:
        values = {name: float(row[name]) for name in ("moe/load_imbalance", "moe/aux_loss", *experts)}
        assert all(math.isfinite(v) for v in values.values()), row
        # max/mean tokens of the worst layer: 1 when balanced, at most E/k = 2 with top-2 of 4.
        assert 1.0 <= values["moe/load_imbalance"] <= 2.0 + 1e-6
        assert sum(values[name] for name in experts) == assignments
        assert float(row["moe/dropped_tokens"]) == 0.0  # dropless by default
        assert values["moe/aux_loss"] > 0  # E * sum f_e P_e: 1 when balanced

"""End to end: ``l5d train recipe=tiny_fp8`` trains in FP8 under tp x ZeRO-3 and prints the
numerics guard's bf16 comparison; a bad FP8 option fails before any worker starts."""

from __future__ import annotations

import re

import pytest
from test_cli import l5d  # the same clean environment as every other l5d run


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_fp8_recipe_trains_and_prints_the_guard(tmp_path):
    proc = l5d("train", "recipe=tiny_fp8", "trainer.max_steps=10", f"hydra.run.dir={tmp_path / 'run'}",
               cwd=tmp_path, timeout=370)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "[lightning_5d] precision: fp8 blockwise (torch) on 28 linears" in proc.stdout + proc.stderr
    guard = re.search(r"step 10/10 .* fp8 vs bf16 loss ([0-9.]+)%", proc.stdout)
    assert guard is not None, proc.stdout[-4000:]
    assert float(guard.group(1)) < 1.0
    summary = [line for line in proc.stdout.splitlines() if line.startswith("SUMMARY ")]
    assert "precision=fp8-blockwise" in summary[0] and "zero=3" in summary[0]


@pytest.mark.timeout(120)
def test_a_bad_fp8_option_fails_before_launch(tmp_path):
    proc = l5d("train", "recipe=tiny_fp8", "+precision_options.fp8.fp8_all_gather=true", cwd=tmp_path, timeout=100)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "fp8_all_gather=true needs recipe=tensorwise" in out and "Traceback" not in out

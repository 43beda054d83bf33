"""Save through ModelCheckpoint under one ZeRO stage, resume with fit(ckpt_path=...) under
another, and land exactly where an uninterrupted single-process run lands (fp64)."""

import json
import subprocess

import pytest
import torch

from lightning_5d.testing import run_distributed
from reference import reference_run
from tests_support import SCRIPTS

NUM_SAMPLES = 12  # 2 ranks x 2 sequences: 3 steps per epoch; checkpoints fall on epoch ends


def train(out, zero, epochs, save=None, resume=None):
    args = ["--zero", str(zero), "--max-epochs", str(epochs), "--num-samples", str(NUM_SAMPLES),
            "--precision", "64-true", "--out", str(out)]  # fmt: skip
    if save:
        args += ["--save", save]
    if resume:
        args += ["--resume", str(resume)]
    run_distributed(SCRIPTS / "train_llama.py", 2, args, timeout=240).check()
    return json.loads((out / "result.json").read_text()), torch.load(out / "params.pt")


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("save_zero,resume_zero", [(1, 2), (3, 3), pytest.param(2, 0, marks=pytest.mark.slow)])
def test_resume_under_another_stage_continues_the_same_run(tmp_path, save_zero, resume_zero):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    train(first, save_zero, epochs=1, save="last")
    result, params = train(second, resume_zero, epochs=2, resume=first / "last.ckpt")
    ref_losses, ref_params = reference_run(6, 2, dtype=torch.float64, num_samples=NUM_SAMPLES)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses[3:]), rtol=1e-6, atol=0)
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=1e-7, msg=lambda m: f"{name}: {m}")

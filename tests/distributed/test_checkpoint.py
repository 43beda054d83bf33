"""Checkpoints through Lightning's own entry points, against one uninterrupted process (fp64).

The first run trains two epochs under one ZeRO stage and saves at every epoch end (so a
save in the middle of training must leave training untouched); the second resumes from
the first epoch's checkpoint under another stage and must land where one process lands.
"""

import json

import pytest
import torch

from lightning_5d.testing import run_distributed
from reference import reference_run
from tests_support import SCRIPTS

NUM_SAMPLES = 12  # 2 ranks x 2 sequences: 3 steps per epoch; checkpoints fall on epoch ends


def train(out, zero, epochs, save=False, resume=None):
    args = ["--zero", str(zero), "--max-epochs", str(epochs), "--num-samples", str(NUM_SAMPLES),
            "--precision", "64-true", "--out", str(out)]  # fmt: skip
    if save:
        args.append("--save")
    if resume:
        args += ["--resume", str(resume)]
    run_distributed(SCRIPTS / "train_llama.py", 2, args, timeout=240).check()
    return json.loads((out / "result.json").read_text()), torch.load(out / "params.pt")


def assert_params(params, ref_params):
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=1e-7, msg=lambda m: f"{name}: {m}")


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "save_zero,resume_zero",
    [
        (1, 2),
        (1, 3),  # ZeRO-1/2 write and ZeRO-3 (FSDP2) reads the same FQN-keyed format ...
        pytest.param(3, 0, marks=pytest.mark.slow),  # ... and back
        pytest.param(3, 3, marks=pytest.mark.slow),
        pytest.param(2, 0, marks=pytest.mark.slow),
    ],
)
def test_save_mid_run_and_resume_under_another_stage(tmp_path, save_zero, resume_zero):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    ref_losses, ref_params = reference_run(6, 2, dtype=torch.float64, num_samples=NUM_SAMPLES)
    result, params = train(first, save_zero, epochs=2, save=True)
    assert_params(params, ref_params)  # saving after epoch 0 changed nothing
    result, params = train(second, resume_zero, epochs=2, resume=first / "epoch=0.ckpt")
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses[3:]), rtol=1e-6, atol=0)
    assert_params(params, ref_params)

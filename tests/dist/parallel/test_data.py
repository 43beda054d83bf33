"""ZeRO-0..3 and HSDP against a single-process run of the same module (fp32)."""

import json

import pytest
import torch

from lightning_5d.testing import run_distributed
from reference import reference_run

from tests_support import SCRIPTS

STEPS = 5
RTOL = 1e-5  # per-step loss, relative
PARAM_ATOL = 1e-5  # parameters: Adam amplifies summation-order noise where a gradient nearly cancels


def run_layout(tmp_path, nproc, zero, dp_replicate=1, accumulate=1, clip=None, extra=()):
    args = ["--zero", str(zero), "--dp-replicate", str(dp_replicate), "--accumulate", str(accumulate),
            "--steps", str(STEPS), "--out", str(tmp_path), *extra]  # fmt: skip
    if clip is not None:
        args += ["--clip", str(clip)]
    run_distributed(SCRIPTS / "train_llama.py", nproc, args, timeout=240).check()
    result = json.loads((tmp_path / "result.json").read_text())
    return result, torch.load(tmp_path / "params.pt")


def assert_matches_reference(result, params, data_ranks, accumulate, clip):
    ref_losses, ref_params = reference_run(STEPS, data_ranks, accumulate, clip)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=RTOL, atol=0)
    assert params.keys() == ref_params.keys()
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, rtol=RTOL, atol=PARAM_ATOL, msg=lambda m: f"{name}: {m}")


FAST = [  # (nproc, zero, dp_replicate, accumulate, clip)
    (2, 0, 1, 2, 0.5),
    (2, 1, 1, 2, 0.5),
    (2, 2, 1, 2, 0.5),
    (2, 3, 1, 2, 0.5),
]
FULL = [
    (2, 0, 1, 1, None),
    (2, 1, 1, 1, None),
    (2, 2, 1, 1, None),
    (2, 3, 1, 1, None),
    (4, 1, 1, 2, 0.5),
    (4, 2, 1, 1, 0.5),
    (4, 3, 1, 2, None),
    (4, 1, 2, 2, 0.5),  # HSDP: 2 replicas x 2 shards
    (4, 2, 2, 1, None),
    (4, 3, 2, 2, 0.5),
]


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("nproc,zero,dp_replicate,accumulate,clip", FAST)
def test_zero_matches_single_process(tmp_path, nproc, zero, dp_replicate, accumulate, clip):
    result, params = run_layout(tmp_path, nproc, zero, dp_replicate, accumulate, clip)
    assert_matches_reference(result, params, nproc, accumulate, clip)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("nproc,zero,dp_replicate,accumulate,clip", FULL)
def test_zero_matches_single_process_full(tmp_path, nproc, zero, dp_replicate, accumulate, clip):
    result, params = run_layout(tmp_path, nproc, zero, dp_replicate, accumulate, clip)
    assert_matches_reference(result, params, nproc, accumulate, clip)

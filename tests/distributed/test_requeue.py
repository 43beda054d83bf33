"""SLURM auto-requeue end to end on 2 processes: a signal mid-epoch, a save, the requeue command, a resume.

A fake ``scontrol`` first on ``PATH`` records its arguments; ``SLURM_JOB_ID=4242``. The
interrupted run must exit 0 having saved and called ``scontrol requeue 4242``; the same
command started again (as SLURM restarts a requeued job) must resume from the saved
checkpoint, and the two runs' per-step losses together must equal an uninterrupted run's
(fp32; the same 2-process layout, so the same reduction order).
"""

import json
import os
import stat
import time

import pytest
import torch

from lightning_5d.testing import run_distributed
from tests_support import SCRIPTS

STEPS = 8
SIGNAL_STEP = 3  # sent inside the 4th optimizer step: saved as requeue-step=4, mid-epoch (64 steps per epoch)
JOB_ID = "4242"


def fake_scontrol(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol_calls.txt"
    script = bin_dir / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> "{calls}"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return bin_dir, calls


def run(tmp_path, name, dirpath, env, signal=None, extra=(), send_at=SIGNAL_STEP):
    out = tmp_path / name
    out.mkdir(exist_ok=True)
    args = ["--dirpath", str(dirpath), "--out", str(out), "--steps", str(STEPS), "--send-at-step", str(send_at)]
    if signal:
        args += ["--send-signal", signal]
    args += list(extra)
    start = time.monotonic()
    run_distributed(SCRIPTS / "requeue_train.py", 2, args, timeout=240, env=env).check()  # exit code 0
    results = sorted(out.glob("result-*.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(results[-1].read_text()), time.monotonic() - start


def interrupted_and_resumed(tmp_path, signal):
    bin_dir, calls = fake_scontrol(tmp_path)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": JOB_ID}
    reference, _ = run(tmp_path, "uninterrupted", tmp_path / "requeue_uninterrupted", env)
    assert reference["outcome"] is None and reference["end_step"] == STEPS and len(reference["losses"]) == STEPS
    assert not calls.exists(), "no signal, no requeue"

    dirpath = tmp_path / "requeue"
    first, first_s = run(tmp_path, "job", dirpath, env, signal=signal)
    assert first["received"] == [None, signal], "only rank 1 got the signal"
    assert first["outcome"] == "requeued" and first["resumed_from"] is None
    assert first["end_step"] == SIGNAL_STEP + 1, "saved and stopped at the step boundary after the signal"
    assert first["saved"] == str(dirpath / f"requeue-step={SIGNAL_STEP + 1}.ckpt")
    assert calls.read_text().splitlines() == [f"requeue {JOB_ID}"], "rank 0 alone ran it, once, with the job id"
    assert first["handlers_in_training"] == {"SIGUSR1": "SignalFlag", "SIGTERM": "SignalFlag"}
    assert first["handlers_restored"]

    from lightning_5d.checkpoint import latest_checkpoint

    assert latest_checkpoint(dirpath) == dirpath / f"requeue-step={SIGNAL_STEP + 1}.ckpt"

    second, second_s = run(tmp_path, "job", dirpath, env)  # the requeued job: same command, same environment
    assert second["resumed_from"] == first["saved"] and second["start_step"] == SIGNAL_STEP + 1
    assert second["outcome"] is None and second["end_step"] == STEPS
    assert calls.read_text().splitlines() == [f"requeue {JOB_ID}"], "the resumed run did not requeue again"

    # The resumed run continues the epoch's data where the interrupted one stopped ...
    for rank in range(2):
        assert first["batches"][rank] + second["batches"][rank] == reference["batches"][rank], f"rank {rank} data"
    # ... and lands on the uninterrupted run's losses.
    losses = torch.tensor(first["losses"] + second["losses"])
    expected = torch.tensor(reference["losses"])
    torch.testing.assert_close(losses, expected, rtol=1e-6, atol=0)
    diff = float((losses - expected).abs().max())
    print(f"{signal}: {STEPS} steps, saved at {SIGNAL_STEP + 1}; max |loss diff| {diff:.2e}; ", end="")
    print(f"interrupted run {first_s:.1f} s, resumed run {second_s:.1f} s")


@pytest.mark.distributed
@pytest.mark.slow  # the fast tier keeps the 2-process rollback + fallback case (checkpoint/test_lineage.py)
@pytest.mark.timeout(600)
def test_sigusr1_mid_epoch_saves_requeues_and_resumes_to_the_same_losses(tmp_path):
    interrupted_and_resumed(tmp_path, "SIGUSR1")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_mid_epoch_saves_requeues_and_resumes_to_the_same_losses(tmp_path):
    interrupted_and_resumed(tmp_path, "SIGTERM")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("signal", ["SIGUSR1", "SIGTERM"])
def test_a_signal_before_fit_saves_at_the_first_step_and_requeues(tmp_path, signal):
    bin_dir, calls = fake_scontrol(tmp_path)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": JOB_ID}
    dirpath = tmp_path / "requeue"
    first, _ = run(tmp_path, "job", dirpath, env, signal=signal, extra=["--send-before-fit"])
    assert first["received"] == [None, signal] and first["outcome"] == "requeued"
    assert first["end_step"] == 1 and first["saved"] == str(dirpath / "requeue-step=1.ckpt")
    assert calls.read_text().splitlines() == [f"requeue {JOB_ID}"]
    second, _ = run(tmp_path, "job", dirpath, env)
    assert second["resumed_from"] == first["saved"] and second["end_step"] == STEPS and second["outcome"] is None


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_fresh_run_in_a_shared_folder_is_requeued_into_its_own_checkpoint(tmp_path):
    """job-local: an earlier run's requeue-step=7 is in the folder; a fresh run there is signalled
    at step 3; the requeued job must continue the fresh run (requeue-step=4), not the old one."""
    bin_dir, calls = fake_scontrol(tmp_path)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": JOB_ID}
    dirpath = tmp_path / "requeue"
    earlier, _ = run(tmp_path, "earlier", dirpath, env, signal="SIGUSR1", send_at=6)
    assert earlier["saved"] == str(dirpath / "requeue-step=7.ckpt")
    fresh, _ = run(tmp_path, "fresh", dirpath, env, signal="SIGUSR1", extra=["--fresh"])
    assert fresh["resumed_from"] is None and fresh["saved"] == str(dirpath / f"requeue-step={SIGNAL_STEP + 1}.ckpt")
    requeued, _ = run(tmp_path, "fresh", dirpath, env)
    assert requeued["resumed_from"] == fresh["saved"] and requeued["start_step"] == SIGNAL_STEP + 1
    assert (dirpath / "requeue-step=7.ckpt").exists()  # the earlier run's: kept

"""What a crash, a late disk or the wrong model does to sharded checkpoints: `latest` always
names a complete one, resuming from it gives the uninterrupted losses, and a checkpoint of
another model is refused with the names that do not match."""

import pytest

from lightning_5d.checkpoint import latest_checkpoint
from reference import reference_run
from tests_support import SCRIPTS, assert_equivalent, run_distributed, run_layout

STEPS, NUM_SAMPLES = 6, 16  # 2 ranks x 2 sequences: 4 steps per epoch


def _train(out, extra, steps=STEPS, model="tiny"):
    out.mkdir(exist_ok=True)
    extra = ["--num-samples", str(NUM_SAMPLES), *extra]
    return run_layout(out, 2, zero=1, steps=steps, model=model, extra=extra)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_sigkill_during_a_save_leaves_latest_on_the_previous_checkpoint(tmp_path):
    out = tmp_path / "killed"
    out.mkdir()
    args = ["--zero", "1", "--steps", str(STEPS), "--num-samples", str(NUM_SAMPLES), "--out", str(out),
            "--save-every", "2", "--kill-during-save", "4"]  # fmt: skip
    run = run_distributed(SCRIPTS / "train_llama.py", 2, args, timeout=240)
    assert run.returncode != 0 and not run.timed_out
    assert latest_checkpoint(out) == out / "step=2.ckpt"
    assert (out / "latest").read_text().strip() == "step=2.ckpt"
    assert not (out / "step=4.ckpt").exists()  # the unfinished save never took the final name
    ref_losses, ref_params = reference_run(STEPS, 2, num_samples=NUM_SAMPLES)
    resumed, params = _train(tmp_path / "resumed", ["--resume", str(latest_checkpoint(out))])
    assert_equivalent(resumed["losses"], params, ref_losses[2:], ref_params)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_async_save_with_keep_last_k_resumes_exactly(tmp_path):
    out = tmp_path / "async"
    ref_losses, ref_params = reference_run(STEPS, 2, num_samples=NUM_SAMPLES)
    first, params = _train(out, ["--save-every", "2", "--checkpoint-write", "async", "--keep-last-k", "2"])
    assert_equivalent(first["losses"], params, ref_losses, ref_params)
    assert sorted(p.name for p in out.glob("*.ckpt")) == ["step=4.ckpt", "step=6.ckpt"]
    assert latest_checkpoint(out) == out / "step=6.ckpt"
    resumed, params = _train(tmp_path / "resumed", ["--resume", str(out / "step=4.ckpt")])
    assert_equivalent(resumed["losses"], params, ref_losses[4:], ref_params)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_checkpoint_of_another_model_is_refused_with_what_differs(tmp_path):
    out = tmp_path / "tiny"
    _train(out, ["--save-every", "2"], steps=2)
    before = sorted((p.name, p.stat().st_size) for p in (out / "step=2.ckpt").iterdir())
    args = ["--zero", "1", "--steps", "4", "--model", "tiny_deep", "--num-samples", str(NUM_SAMPLES),
            "--out", str(tmp_path / "deep"), "--resume", str(out / "step=2.ckpt")]  # fmt: skip
    (tmp_path / "deep").mkdir()
    run = run_distributed(SCRIPTS / "train_llama.py", 2, args, timeout=240)
    assert run.returncode != 0 and not run.timed_out
    assert "does not belong to this model" in run.output
    assert "missing (54): model.layers.2." in run.output  # tiny has 2 blocks, tiny_deep 8 (9 tensors each)
    assert sorted((p.name, p.stat().st_size) for p in (out / "step=2.ckpt").iterdir()) == before

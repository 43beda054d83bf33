"""``pretrained=`` (safetensors) and resume read each rank's slices straight into its shards,
under ZeRO-3, tp2 and a layout change between save and resume: the values loaded are the
file's, and training from them (and resumed mid-run under the other layout) lands where one
process lands from the same weights.

The default tier runs its four cases in one 2-process launch (each case saves at step 2 and
the next resumes from it under the other layout); the 4-process cases (tp2 x ZeRO-3 written,
ZeRO-2 flat slices over 4 data ranks read, and back) are ``extended``.
"""

import json

import pytest
import torch

from lightning_5d.checkpoint.export import save_safetensors
from reference import reference_run
from tests_support import MODELS, SCRIPTS, RecordingLM, assert_equivalent, read_run, run_distributed

STEPS, SAVE_AT = 4, 2
GLOBAL_BATCH = 4
NUM_SAMPLES = 16  # 4 steps per epoch: step 2 is mid-epoch


def _weights(tmp_path):
    """Pretrained weights other than the seeded initialization, as a safetensors file."""
    torch.manual_seed(1)
    state = {k: v.detach().clone() for k, v in RecordingLM(config=MODELS["tiny"]).state_dict().items()}
    path = tmp_path / "pretrained.safetensors"
    save_safetensors(state, path)
    return state, path


def _argv(zero, tp, data_ranks, extra):
    return ["--zero", str(zero), "--tp", str(tp), "--steps", str(STEPS), "--num-samples", str(NUM_SAMPLES),
            "--batch-size", str(GLOBAL_BATCH // data_ranks), *map(str, extra)]  # fmt: skip


def _launch(tmp_path, nproc, cases):
    """Every case in one launch, in order (a resume reads what an earlier case saved)."""
    batch = [{"argv": _argv(*layout, extra), "out": str(tmp_path / name)} for name, layout, extra in cases]
    listing = tmp_path / f"cases_{nproc}.json"
    listing.write_text(json.dumps(batch))
    run_distributed(SCRIPTS / "train_llama.py", nproc, ["--cases", str(listing)],
                    timeout=60 + 45 * len(cases)).check()  # fmt: skip


def _check(tmp_path, state, cases):
    ref_losses, ref_params = reference_run(STEPS, 1, batch_size=GLOBAL_BATCH, num_samples=NUM_SAMPLES,
                                           initial_state=state)  # fmt: skip
    for name, _, extra in cases:
        result, params = read_run(tmp_path / name)
        if "--pretrained" in extra:  # every entry, whichever rank held which slice, is the file's
            loaded = torch.load(tmp_path / name / "loaded.pt")
            assert loaded.keys() == state.keys(), name
            for k, v in state.items():
                assert torch.equal(loaded[k], v), f"{name}: {k}"
            assert_equivalent(result["losses"], params, ref_losses, ref_params)
        else:  # resumed at SAVE_AT under another layout
            assert_equivalent(result["losses"], params, ref_losses[SAVE_AT:], ref_params)


def _cases(tmp_path, path, written, read):
    """(name, (zero, tp, data ranks), extra) pairs: each layout loads pretrained= and saves; the other resumes."""
    cases = []
    for (a_name, a), (b_name, b) in ((written, read), (read, written)):
        cases.append((f"{a_name}_pretrained", a, ["--pretrained", path, "--save-every", SAVE_AT]))
        cases.append((f"{b_name}_from_{a_name}", b, ["--resume", tmp_path / f"{a_name}_pretrained" / f"step={SAVE_AT}.ckpt"]))
    return cases


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_pretrained_and_resume_read_their_slices_under_zero3_tp2_and_layout_changes(tmp_path):
    state, path = _weights(tmp_path)
    cases = _cases(tmp_path, path, ("zero3", (3, 1, 2)), ("tp2", (1, 2, 1)))
    _launch(tmp_path, 2, cases)
    _check(tmp_path, state, cases)


@pytest.mark.distributed
@pytest.mark.extended
@pytest.mark.timeout(600)
def test_tp2_zero3_and_zero2_flat_slices_over_four_ranks(tmp_path):
    state, path = _weights(tmp_path)
    cases = _cases(tmp_path, path, ("tp2_zero3", (3, 2, 2)), ("zero2_dp4", (2, 1, 4)))
    _launch(tmp_path, 4, cases)
    _check(tmp_path, state, cases)

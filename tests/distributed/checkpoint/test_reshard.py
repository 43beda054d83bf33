"""A sharded checkpoint written under one layout resumes under another, mid-epoch, and
training goes on with the losses one process has at those steps.

The pairs keep the global batch the same (fewer data ranks take bigger per-rank batches),
so the single-process reference is one run for both halves: the first layout must match
its first SAVE_AT steps, and the second, resumed from the step-SAVE_AT checkpoint, the rest.
"""

import pytest

from reference import reference_run
from tests_support import assert_equivalent, run_layout

STEPS, SAVE_AT = 6, 2
NUM_SAMPLES = 32  # global batch 8: 4 steps per epoch, so step 2 is mid-epoch

# (model, global batch, (nproc, layout args) written, (nproc, layout args) read)
PAIRS = {
    "dp4_zero3-to-tp2_pp2": ("tiny_deep", 8, (4, ["--zero", "3"]),
                             (4, ["--tp", "2", "--pp", "2", "--zero", "1", "--microbatches", "2"])),
    "tp2-to-tp1_dp2": ("tiny", 8, (2, ["--tp", "2", "--zero", "1"]), (2, ["--zero", "2"])),
    "pp4-to-pp2_dp2": ("tiny_deep", 8, (4, ["--pp", "4", "--zero", "1", "--microbatches", "4"]),
                       (4, ["--pp", "2", "--zero", "1", "--microbatches", "2"])),
    "ep2-to-ep4": ("tiny_moe", 8, (2, ["--ep", "2", "--zero", "1"]), (4, ["--ep", "4", "--zero", "1"])),
    "pp2_zero3-to-dp4_zero1": ("tiny_deep", 8, (4, ["--pp", "2", "--zero", "3", "--microbatches", "2"]),
                               (4, ["--zero", "1"])),
}  # fmt: skip
# Tied embeddings: the pipeline's two copies are saved once, under the names one process uses
# (model and optimizer state), so a checkpoint moves to and from pp unchanged.
TIED_PAIRS = {
    "tied_pp2_zero3-to-dp2_zero1": ("tiny_tied_deep", 8, (2, ["--pp", "2", "--zero", "3", "--microbatches", "2"]),
                                    (2, ["--zero", "1"])),
    "tied_dp2_zero1-to-pp2_interleaved": ("tiny_tied_deep", 8, (2, ["--zero", "1"]),
                                          (2, ["--pp", "2", "--zero", "1", "--microbatches", "2",
                                               "--schedule", "interleaved_1f1b", "--virtual-stages", "2"])),
}  # fmt: skip
PAIRS.update(TIED_PAIRS)


def _data_ranks(nproc: int, args: list[str]) -> int:
    sizes = {k: int(args[args.index(k) + 1]) for k in ("--tp", "--pp") if k in args}
    return nproc // (sizes.get("--tp", 1) * sizes.get("--pp", 1))


def _run(out, model, batch, nproc, layout, extra):
    out.mkdir()
    per_rank = batch // _data_ranks(nproc, layout)
    args = ["--num-samples", str(NUM_SAMPLES), "--batch-size", str(per_rank), *layout, *extra]
    zero = args.pop(args.index("--zero") + 1)
    args.remove("--zero")
    return run_layout(out, nproc, zero=int(zero), steps=STEPS, model=model, extra=args)


@pytest.mark.distributed
@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    "pair",
    [
        pytest.param(p, marks=pytest.mark.extended if p in TIED_PAIRS else pytest.mark.slow)
        if p != "tp2-to-tp1_dp2"
        else p
        for p in PAIRS
    ],
)
def test_resume_under_another_layout_continues_the_losses(tmp_path, pair):
    model, batch, (n_write, write), (n_read, read) = PAIRS[pair]
    ref_losses, ref_params = reference_run(STEPS, 1, model=model, batch_size=batch, num_samples=NUM_SAMPLES)
    first, params = _run(tmp_path / "write", model, batch, n_write, write, ["--save-every", str(SAVE_AT)])
    assert_equivalent(first["losses"], params, ref_losses, ref_params)  # saving changed nothing
    checkpoint = tmp_path / "write" / f"step={SAVE_AT}.ckpt"
    assert (checkpoint / ".metadata").is_file(), sorted(p.name for p in (tmp_path / "write").iterdir())
    second, params = _run(tmp_path / "read", model, batch, n_read, read, ["--resume", str(checkpoint)])
    assert_equivalent(second["losses"], params, ref_losses[SAVE_AT:], ref_params)

"""FiveDPrecision in multi-process training: bf16 mixed against fp32, each FP8 recipe against
bf16 mixed from the same init and data, and FP8 composed with ZeRO-3 (FP8 all-gather), tp, ep,
pp and cp against the same layout in bf16.

Tolerances. bf16 rounds every activation to 8 bits of mantissa: over 5 steps of the tiny
model its losses stay within 1 % of fp32 (measured ~0.1 %). FP8 adds ~4 % relative error per
GEMM operand pair (E4M3: 3 mantissa bits); per step the loss moves by ~0.2 % against bf16
(measured), so 1 % per step over 5 steps, and the issue's 2 % on the final loss after 50 steps.
"""

import pytest

from reference import reference_run
from tests_support import LayoutRuns, relative, run_distributed, run_layout, selected_cases

RECIPES = ["tensorwise", "delayed", "rowwise", "blockwise", "mxfp8"]
STEP_RTOL = 0.01
FINAL_RTOL = 0.02


def composed_runs(test_name: str, nproc: int, zero: int, recipe: str, extra: tuple) -> dict:
    """The FP8 run and its bf16-mixed twin (the same layout, FP8 all-gather off) of one composition."""
    bf16_extra = tuple(a for a in extra if a != "--fp8-all-gather")
    key = (test_name, nproc, zero, recipe, extra)
    return {
        (*key, "fp8"): (nproc, dict(zero=zero, steps=5, precision=f"fp8-{recipe}", extra=extra)),
        (*key, "bf16"): (nproc, dict(zero=zero, steps=5, precision="bf16-mixed", extra=bf16_extra)),
    }


def layout_case(test_name: str, params: dict):
    """The train_llama.py runs each test reads, keyed by test and parameters."""
    if test_name == "test_bf16_mixed_tracks_fp32":
        return (test_name, params["zero"]), (2, dict(zero=params["zero"], steps=5, precision="bf16-mixed", clip=0.5))
    if test_name == "test_fp32_accumulation_tracks_fp32":
        options = dict(zero=params["zero"], accumulate=2, steps=4, precision="bf16-mixed", clip=0.5,
                       extra=("--accumulation-dtype", "fp32"))  # fmt: skip
        return (test_name, params["zero"]), (2, options)
    if test_name.startswith("test_fp8_composes_with_each_dim"):
        return composed_runs(test_name, *(params[k] for k in ("nproc", "zero", "recipe", "extra")))
    if test_name == "test_numerics_guard_logs_the_bf16_loss_difference":
        return (test_name,), (2, dict(zero=1, steps=5, precision="fp8-blockwise", extra=("--numerics-every", "2")))
    return None


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Every selected case of this module's batched tests, trained in one launch per process count."""
    return LayoutRuns(tmp_path_factory.mktemp("precision"), selected_cases(request, layout_case))


@pytest.mark.distributed
@pytest.mark.timeout(900)  # the first case of a process count trains its whole batch
@pytest.mark.parametrize("zero", [pytest.param(0, marks=pytest.mark.slow), 1, pytest.param(3, marks=pytest.mark.slow)])
def test_bf16_mixed_tracks_fp32(runs, zero):
    result, _ = runs[("test_bf16_mixed_tracks_fp32", zero)]
    ref_losses, _ = reference_run(5, 2, 1, 0.5)
    rel = relative(result["losses"], ref_losses)
    print(f"bf16-mixed zero={zero}: max per-step loss difference to fp32 {rel:.3%}")
    assert rel < STEP_RTOL


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("zero", [pytest.param(0, marks=pytest.mark.slow), 1, 3])
def test_fp32_accumulation_tracks_fp32(runs, zero):
    result, _ = runs[("test_fp32_accumulation_tracks_fp32", zero)]
    ref_losses, _ = reference_run(4, 2, 2, 0.5)
    assert relative(result["losses"], ref_losses) < STEP_RTOL


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fp32_accumulation_with_sequence_parallel_under_zero3(tmp_path):
    """SP's sum over tp of the norm gradients runs once per step, after the last micro-batch."""
    extra = ("--accumulation-dtype", "fp32")
    result, _ = run_layout(
        tmp_path, 4, 3, accumulate=2, steps=4, precision="bf16-mixed", clip=0.5, tp=2, sp=True, extra=extra
    )
    ref_losses, _ = reference_run(4, 2, 2, 0.5)
    assert relative(result["losses"], ref_losses) < STEP_RTOL


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_each_fp8_recipe_ends_within_2_percent_of_bf16_after_50_steps(tmp_path):
    """ "Final loss" is the mean of the last 10 steps: one step's loss after 50 steps of this tiny
    model moves by several percent under any change of numerics (fp32 itself ends 4.9 % from bf16
    mixed at step 50, 1.4 % over the last 10), so a single step would test the noise."""

    def run(precision):
        out = tmp_path / precision
        out.mkdir()
        result, _ = run_layout(out, 2, 1, steps=50, precision=precision)
        return result["losses"]

    def final(losses):
        return sum(losses[-10:]) / 10

    bf16 = run("bf16-mixed")
    for recipe in RECIPES:
        fp8 = run(f"fp8-{recipe}")
        rel = abs(final(fp8) - final(bf16)) / final(bf16)
        last = (fp8[-1] - bf16[-1]) / bf16[-1]
        print(f"{recipe}: last-10 loss {final(fp8):.4f} vs bf16 {final(bf16):.4f} ({rel:.3%}); last step {last:+.3%}")
        assert rel < FINAL_RTOL, (recipe, final(fp8), final(bf16))
        assert final(fp8) < 0.8 * fp8[0]  # it trained


# (nproc, zero, recipe, extra script args): FP8 composed with each dim, against the same layout in bf16
COMPOSED_FAST = [
    (2, 3, "tensorwise", ("--fp8-all-gather",)),  # ZeRO-3 gathering FP8 weights
    (2, 1, "blockwise", ("--tp", "2", "--clip", "0.5")),  # row-parallel GEMMs keep their FP8 matmul
    (2, 1, "mxfp8", ("--model", "tiny_moe", "--ep", "2")),
]
COMPOSED_FULL = [
    (4, 3, "tensorwise", ("--fp8-all-gather", "--tp", "2", "--sp")),
    (4, 3, "tensorwise", ("--fp8-all-gather", "--model", "tiny_moe", "--ep", "2")),  # experts gather bf16
    (2, 1, "delayed", ("--pp", "2", "--microbatches", "2")),
    (2, 1, "rowwise", ("--cp", "2")),
    (2, 2, "tensorwise", ("--accumulate", "2")),
]


def check_composed(runs, test_name, nproc, zero, recipe, extra):
    fp8, _ = runs[(test_name, nproc, zero, recipe, extra, "fp8")]
    bf16, _ = runs[(test_name, nproc, zero, recipe, extra, "bf16")]
    rel = relative(fp8["losses"], bf16["losses"])
    print(f"fp8-{recipe} {' '.join(extra)} (zero={zero}): max per-step loss difference to bf16 {rel:.3%}")
    assert rel < STEP_RTOL, (fp8["losses"], bf16["losses"])


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("nproc, zero, recipe, extra", COMPOSED_FAST)
def test_fp8_composes_with_each_dim(runs, nproc, zero, recipe, extra):
    check_composed(runs, "test_fp8_composes_with_each_dim", nproc, zero, recipe, extra)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("nproc, zero, recipe, extra", COMPOSED_FULL)
def test_fp8_composes_with_each_dim_full(runs, nproc, zero, recipe, extra):
    check_composed(runs, "test_fp8_composes_with_each_dim_full", nproc, zero, recipe, extra)


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_numerics_guard_logs_the_bf16_loss_difference(runs):
    result, _ = runs[("test_numerics_guard_logs_the_bf16_loss_difference",)]
    logged = result["model_state_bytes"][0]["fp8_loss_rel_diff"]
    # The check ran the step's forward again with FP8 off: training_step ran at steps 0, 2, 4 twice
    # (bf16 first), so the recording model saw 8 losses; each pair is (bf16, fp8) of one step.
    losses = result["losses"]
    assert len(losses) == 8
    pairs = [(losses[0], losses[1]), (losses[3], losses[4]), (losses[6], losses[7])]
    for bf16, fp8 in pairs:
        assert bf16 != fp8 and abs(fp8 - bf16) / bf16 < STEP_RTOL
    assert 0 < logged < STEP_RTOL  # step 4's difference, averaged over the data ranks


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero, precision", [(0, "bf16-mixed"), pytest.param(1, "fp8-delayed", marks=pytest.mark.slow)])
def test_resume_under_mixed_precision_continues_the_run(tmp_path, zero, precision):
    """The optimizer state (keyed through the masters) and the delayed-scaling histories come
    back; the fp32 masters restart from the saved bf16 weights, so the losses agree to bf16."""
    import json

    from tests_support import SCRIPTS

    def train(out, resume=None):
        out.mkdir()
        args = ["--zero", str(zero), "--max-epochs", "2", "--num-samples", "12", "--precision", precision,
                "--out", str(out), "--save", *(["--resume", str(resume)] if resume else [])]  # fmt: skip
        run_distributed(SCRIPTS / "train_llama.py", 2, args, timeout=240).check()
        return json.loads((out / "result.json").read_text())["losses"]

    whole = train(tmp_path / "whole")
    if precision == "fp8-delayed":
        from lightning_5d.checkpoint import sharded

        path = tmp_path / "whole" / "epoch=0.ckpt"
        histories = sharded.read_meta(path)["FiveDPrecision"]["fp8_amax_history"]
        assert len(histories) == 2 * 7 and all(h["input"][0] > 0 for h in histories.values())
        assert not any("amax" in key for key in sharded.tensor_shapes(path))
    resumed = train(tmp_path / "resumed", resume=tmp_path / "whole" / "epoch=0.ckpt")
    assert len(resumed) == 3
    assert relative(resumed, whole[3:]) < 2e-3


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_manual_optimization_clips_the_master_gradients(tmp_path):
    import json

    from tests_support import SCRIPTS

    run_distributed(SCRIPTS / "precision_manual.py", 1, ["--out", str(tmp_path)], timeout=200).check()
    result = json.loads((tmp_path / "result.json").read_text())
    # Two SGD steps at lr 0.1 with the gradient norm clipped to 1e-6 move no weight by more than
    # 2e-6, up to the bf16 rounding of the weights themselves (ulp ~ 2^-8 of |w| <= ~0.1).
    assert result["moved"] < 1e-3, result
    # Without clipping, two more steps in a second fit of the same Trainer move the weights.
    assert result["refit_moved"] > 1e-3, result
    assert "toggle_optimizer switches requires_grad on the fp32 masters" in result["error"]

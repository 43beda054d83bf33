"""The verifier's comparison: the measure, the tolerances and the error text (single process)."""

import math

import pytest
import torch

from lightning_5d.config import LayoutError, ParallelConfig, VerifyMode
from lightning_5d.verify import Difference, PieceResult, difference, tolerance_for
from lightning_5d.verify.compare import mismatch_message


def test_equal_outputs_have_zero_error():
    x = torch.randn(2, 8, 16)
    d = difference(x.clone(), x)
    assert d.max_abs == 0.0 and d.relative == 0.0 and not d.exceeds(1e-12)


def test_residual_piece_is_measured_against_its_own_contribution():
    x = torch.randn(1, 8, 16) * 10  # a large residual stream
    update = torch.randn(1, 8, 16) * 0.01
    wrong_update = update.flip(-1)  # e.g. heads swapped: same size, other values
    reference, parallel = x + update, x + wrong_update
    against_output = difference(parallel, reference)
    against_update = difference(parallel, reference, residual_input=x)
    assert against_output.relative < 1e-2  # the residual hides the broken block ...
    expected = (wrong_update - update).norm() / update.norm()
    assert against_update.relative == pytest.approx(float(expected), rel=1e-3)  # ... its update does not
    assert against_update.exceeds(tolerance_for(torch.float32))


def test_fp32_reassociation_passes_and_a_lost_scale_fails():
    torch.manual_seed(0)
    w = torch.randn(64, 32, dtype=torch.float64)
    x = torch.randn(4, 64, dtype=torch.float64)
    reference = (x @ w).float()
    split = (x[:, :32] @ w[:32] + x[:, 32:] @ w[32:]).float()  # a tp row split: partial sums added
    assert not difference(split, reference).exceeds(tolerance_for(torch.float32))
    assert difference(reference / 8, reference).exceeds(tolerance_for(torch.float32))  # an embedding's sqrt(64)


def test_shape_mismatch_and_non_finite_values_fail_with_a_note():
    d = difference(torch.zeros(2, 3), torch.zeros(2, 4))
    assert math.isinf(d.relative) and "shape (2, 3)" in d.text() and "(2, 4)" in d.text()
    d = difference(torch.tensor([float("nan"), 1.0]), torch.tensor([0.0, 1.0]))
    assert d.exceeds(1.0) and "non-finite" in d.text()


def test_tolerance_follows_the_compute_dtype():
    assert tolerance_for(torch.float32) == 1e-4
    assert tolerance_for(torch.bfloat16) > tolerance_for(torch.float16) > tolerance_for(torch.float32)


def test_message_names_piece_first_and_worst_output_and_the_way_out():
    tol = 1e-4
    parts = (
        ("m.layers.3.attention.q_proj", Difference(1e-7, 1e-7)),
        ("m.layers.3.attention", Difference(0.2, 0.9)),
        ("m.layers.3.attention.o_proj", Difference(0.3, 1.3)),
    )
    result = PieceResult("block 3", "m.layers.3", Difference(0.25, 0.7), tol, parts)
    assert result.failed
    text = mismatch_message([result], "tp=2")
    assert "block 3 (m.layers.3): relative error 0.7, max abs error 0.25" in text
    assert "first wrong output in execution order: m.layers.3.attention:" in text
    assert "worst output: m.layers.3.attention.o_proj: relative error 1.3" in text
    assert "matching: m.layers.3.attention.q_proj" in text
    assert "model_plan" in text and "verify='off'" in text and "parallel.verify=off" in text


def test_verify_setting_is_an_enum_with_a_clear_error():
    assert ParallelConfig(verify="blocks").verify == VerifyMode.BLOCKS
    assert ParallelConfig(verify="off").verify == VerifyMode.OFF
    assert ParallelConfig(verify="outputs").verify == VerifyMode.OUTPUTS
    with pytest.raises(LayoutError, match=r"verify=True is not valid.*'auto', 'blocks', 'outputs', 'off'"):
        ParallelConfig(verify=True)


def test_a_gradient_off_fails_the_piece_and_is_named_while_the_output_matches():
    tol = tolerance_for(torch.float32)
    grads = (("m.layers.0.attn.q_norm.weight", Difference(0.5, 0.5)), ("m.layers.0.attn.q_proj.weight", Difference(0, 1e-7)))
    result = PieceResult("block 0", "m.layers.0", Difference(1e-7, 1e-7), tol, grads=grads)
    assert result.failed and result.worst_relative() == 0.5
    text = mismatch_message([result], "tp=2")
    assert "block 0 (m.layers.0): the output matches" in text
    assert "gradient of m.layers.0.attn.q_norm.weight: relative error 0.5" in text
    assert "matching gradients: m.layers.0.attn.q_proj.weight" in text
    assert not PieceResult("block 0", "m.layers.0", Difference(0, 0), tol, grads=grads[1:]).failed


def test_a_sub_layer_that_returns_only_its_update_is_measured_against_that_update():
    # A container block's attention sub-layer: the model's loop adds its output to the stream,
    # so the output is the update itself and the block input is the large residual stream.
    x = torch.randn(1, 8, 16) * 10
    update = torch.randn(1, 8, 16) * 0.01
    d = difference(update.flip(-1), update, residual_input=x)
    assert d.relative == pytest.approx(float((update.flip(-1) - update).norm() / update.norm()), rel=1e-6)
    assert d.exceeds(tolerance_for(torch.bfloat16))  # against ‖update − x‖ it would be ~1e-3


def test_gradients_in_reduced_precision_get_their_own_tolerance():
    from lightning_5d.verify.compare import Difference, PieceResult

    output = Difference(0.001, 0.03)
    grads = (("w", Difference(0.002, 0.055)),)
    assert PieceResult("block 0", "layers.0", output, 0.05, grads=grads).failed  # one tolerance for both
    loose = PieceResult("block 0", "layers.0", output, 0.05, grads=grads, grad_tolerance=0.1)
    assert not loose.failed
    halved = (("w", Difference(0.2, 0.5)),)  # a skipped tp sum: half the gradient
    assert PieceResult("block 0", "layers.0", output, 0.05, grads=halved, grad_tolerance=0.1).failed


def test_comparing_float64_tensors_leaves_them_unchanged():
    # .double() of a float64 tensor is the tensor itself: the comparison must not write into the
    # recorded output (a later piece would then be compared against the changed values).
    parallel = torch.randn(4, 8, dtype=torch.float64)
    reference = parallel + 1e-3
    kept = parallel.clone()
    difference(parallel, reference)
    assert torch.equal(parallel, kept)

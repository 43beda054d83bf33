"""nn.TransformerEncoder (nn.MultiheadAttention with its packed in_proj_weight) under TP and TP+SP,
for the settings the zoo's torch_encoder does not exercise: sequence-first tensors, post-norm, a
bool causal mask with a key_padding_mask, a padding mask alone under inference (eval, no grad),
where torch's nested-tensor path runs in one process (tp_torch_encoder_check.py). One forward and backward
against the unsharded model on the same ranks: the loss within 1e-5 relative and every gathered
gradient within 1e-5 relative (norm of the difference over the gradient's norm).
The zoo matrix covers the zoo model's own layouts (tp2, tp2+sp, tp2 x pp2)."""

import json

import pytest

from tests_support import SCRIPTS, run_distributed


@pytest.mark.distributed
@pytest.mark.extended
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2+sp"])
@pytest.mark.parametrize("case", ["seq_first_padding", "batch_first_causal", "batch_first_padding"])
def test_transformer_encoder_matches_the_unsharded_model(tmp_path, case, sp):
    args = ["--case", case, "--out", str(tmp_path), *(["--sp"] if sp else [])]
    run_distributed(SCRIPTS / "tp_torch_encoder_check.py", 2, args, timeout=240).check()
    result = json.loads((tmp_path / "result.json").read_text())
    assert abs(result["loss"] - result["ref_loss"]) <= 1e-5 * abs(result["ref_loss"]), result
    assert {"encoder.layers.0.self_attn.in_proj_weight", "encoder.layers.0.self_attn.out_proj.weight"} <= set(
        result["sharded"]
    )
    if result["eval_error"] is not None:  # inference (eval, no grad), torch's nested-tensor path in one process
        assert result["eval_error"] <= 1e-5, result["eval_error"]
    assert result["state_round_trip"], "the gathered state dict differs from the full one"
    worst = max(result["grad_errors"], key=result["grad_errors"].get)
    assert result["grad_errors"][worst] <= 1e-5, (worst, result["grad_errors"])

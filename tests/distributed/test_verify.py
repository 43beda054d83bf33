"""The plan verifier at setup: correct layouts pass it, deliberately broken plans stop setup.

One 2-process launch runs every selected case of this module (scripts/verify_cases.py);
each broken case must raise PlanVerificationError naming the wrong piece before any
training step, each correct one must train its step. Gradients are compared under ZeRO-3
and activation checkpointing as elsewhere; container blocks are compared sub-layer by
sub-layer.
"""

import json

import pytest

from tests_support import SCRIPTS, run_distributed

# Correct layouts are also checked by every other multi-process test: the verifier is on by
# default wherever tp, cp, pp, ep or FP8 rewrite the forward, so each of their setups must pass it
# (ZeRO-3 alone only when asked: the "zero3" case). Here the fast tier breaks plans on purpose;
# the SP case also shows blocks and head passing next to the wrong embedding.
# The ZeRO-3 and container cases break a gradient sum and a container block's sub-layer; the
# pieces next to them (other gradients, the other sub-layer) pass in the same run.
FAST = ["interleaved_qkv_tp2_guessed", "scaled_embedding_tp2_sp", "head_norm_tp2_unsummed", "pp2_refused_on_stage0",
        "head_norm_tp2_zero3_unsummed", "nested_tp2_cut_plain", "q_proj_grad_doubled_on_rank1_tp2"]  # fmt: skip
EXTENDED = ["tp2", "tp2_sp", "zero3", "cp2", "pp2", "scaled_embedding_tp2", "fused_gate_up_tp2",
            "interleaved_qkv_tp2", "fused_gate_up_tp2_cut_plain", "fused_gate_up_tp2_cut_plain_off",
            "scaled_embedding_cp2", "head_norm_tp2", "head_norm_tp2_zero3", "cp2_zero3", "tp2_sp_zero3", "pp2_zero3",
            "cp2_ac", "head_norm_tp2_ac_unsummed", "nested_tp2", "nested_tp2_zero3", "nested_cp2_zero3"]  # fmt: skip


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory):
    """Every selected case in one launch (start-up dominates a tiny case)."""
    selected = {item.callspec.params["case"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")}  # fmt: skip
    cases = [c for c in FAST + EXTENDED if c in selected]
    out = tmp_path_factory.mktemp("verify") / "cases.jsonl"
    run = run_distributed(SCRIPTS / "verify_cases.py", 2, ["--cases", ",".join(cases), "--out", str(out)],
                          timeout=60 + 30 * len(cases))  # fmt: skip
    run.check()
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    other = [json.loads(line) for line in out.with_name(out.name + ".rank1").read_text().splitlines()]
    return {line["case"]: line for line in lines}, run.output, {line["case"]: line for line in other}


def check(outcomes, case):
    results, output, _ = outcomes
    result = results[case]
    assert result["outcome"] == result["expected"], result["error"]
    if result["expected"] == "refused":
        assert result["steps"] == 0
    elif result["expected"] == "fail":
        assert result["steps"] == 0  # stopped in setup, before step 0
        assert "setup stopped before any training step" in result["error"]
        assert "verify='off'" in result["error"]
    else:
        assert result["steps"] >= 1  # under pp the step runs once per microbatch (and once for the shapes)


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", FAST)
def test_verifier_fast(outcomes, case):
    check(outcomes, case)
    error = outcomes[0][case]["error"]
    if case == "interleaved_qkv_tp2_guessed":
        assert "block 0 (model.layers.0)" in error and "block 1 (model.layers.1)" in error
        # The fused projection itself is exact; the attention that reads its columns per head (o_proj
        # finishes first, the attention module with it) is not.
        assert "first wrong output in execution order: model.layers.0.attention.o_proj:" in error
        assert "matching: model.layers.0.attention.qkv" in error
    if case == "pp2_refused_on_stage0":
        # Rank 0 (stage 0) raised; rank 1 (stage 1) stops with the same message, naming rank 0.
        other = outcomes[2][case]
        assert other["outcome"] == "refused" and other["error"] == error, (error, other)
        assert "block 0 cannot run this probe" in error and "raised on rank 0" in error, error
    if case == "head_norm_tp2_unsummed":
        # Outputs match; the backward finds the per-head norms' gradients (only this rank's heads' part).
        assert "block 0 (model.layers.0): the output matches" in error, error
        assert "gradient of model.layers.0.attention.q_norm.weight" in error, error
        assert "gradient of model.layers.0.attention.k_norm.weight" in error, error
        assert "gradient of model.layers.0.attention.q_proj.weight" not in error, error
    if case == "head_norm_tp2_zero3_unsummed":
        # Under ZeRO-3 too (each unit gathered for its piece's backward; training sums these
        # gradients over tp after the backward): the unsummed norms are named, the rest match.
        assert "block 0 (model.layers.0): the output matches" in error, error
        assert "gradient of model.layers.0.attention.q_norm.weight" in error, error
        assert "matching gradients: model.layers.0.attention_norm.weight, model.layers.0.attention.q_proj" in error
    if case == "nested_tp2_cut_plain":
        # Container blocks (for attn, ff in layers): each sub-layer is a piece; the feed-forward whose
        # fused [gate|up] was cut plainly is named, the attention sub-layer next to it passes.
        assert "block 0 [1] (layers.0.1)" in error and "block 1 [1] (layers.1.1)" in error, error
        assert "first wrong output in execution order: layers.0.1.1.down_proj" in error, error
        assert "block 0 [0]" not in error and "block 1 [0]" not in error, error
    if case == "q_proj_grad_doubled_on_rank1_tp2":
        # Gradients are compared on each rank's shard, their sums added over tp: rank 1's wrong
        # half of a column-parallel weight is named on every rank, next to the matching k_proj.
        assert "block 0 (model.layers.0): the output matches" in error, error
        assert "gradient of model.layers.0.attention.q_proj.weight: relative error" in error, error
        assert "model.layers.0.attention.k_proj.weight" in error.split("matching gradients:")[1], error
        assert outcomes[2][case]["error"] == error  # rank 1 stops with the same message


def check_fused_gate_up(error: str) -> None:
    assert "block 0 (model.layers.0)" in error and "block 1 (model.layers.1)" in error
    # The fused projection itself is exact; what reads its halves goes wrong.
    assert "first wrong output in execution order: model.layers.0.mlp.down_proj" in error
    assert "matching: model.layers.0.attention.q_proj" in error and "mlp.gate_up_proj" in error


@pytest.mark.distributed
@pytest.mark.extended
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", EXTENDED)
def test_verifier_extended(outcomes, case):
    check(outcomes, case)
    result = outcomes[0][case]
    if case == "fused_gate_up_tp2_cut_plain":
        check_fused_gate_up(result["error"])
    if case in ("zero3", "pp2_zero3"):
        # No dimension changes a piece: its backward would be its own code on both sides. Outputs
        # only, and the report says which gradients it left out.
        assert not any(result["compared"].values()), result
        assert len(result["skipped"]) == 1 and "no dimension changed" in result["skipped"][0], result
    if case in ("head_norm_tp2_zero3", "cp2_zero3", "tp2_sp_zero3", "cp2_ac", "nested_tp2_zero3", "nested_cp2_zero3"):
        # Gradients compared under ZeRO-3 and activation checkpointing too: every piece, every parameter.
        assert result["skipped"] == [] and all(result["compared"].values()), result
    if case.startswith("nested_") and result["expected"] == "pass":
        pieces = ["block 0 [0]", "block 0 [1]", "block 1 [0]", "block 1 [1]"]
        assert all(len(result["compared"][p]) >= 4 for p in pieces), result  # norm, projections

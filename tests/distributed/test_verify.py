"""The plan verifier at setup: correct layouts pass it, deliberately broken plans stop setup.

One 2-process launch runs every selected case of this module (scripts/verify_cases.py);
each broken case must raise PlanVerificationError naming the wrong piece before any
training step, each correct one must train its step.
"""

import json

import pytest

from tests_support import SCRIPTS, run_distributed

# Correct layouts are also checked by every other multi-process test: the verifier is on by
# default, so each of their setups must pass it. Here the fast tier breaks plans on purpose;
# the SP case also shows blocks and head passing next to the wrong embedding.
FAST = ["interleaved_qkv_tp2_guessed", "scaled_embedding_tp2_sp", "head_norm_tp2_unsummed", "pp2_refused_on_stage0"]
EXTENDED = ["tp2", "tp2_sp", "zero3", "cp2", "pp2", "scaled_embedding_tp2", "fused_gate_up_tp2",
            "interleaved_qkv_tp2", "fused_gate_up_tp2_cut_plain", "fused_gate_up_tp2_cut_plain_off",
            "scaled_embedding_cp2", "head_norm_tp2"]


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
    if case == "fused_gate_up_tp2_cut_plain":
        check_fused_gate_up(outcomes[0][case]["error"])

"""Context parallelism of unchanged models: training equivalence, per-rank work and memory, bad input.

Equivalence runs train under FiveDStrategy(cp=...) and the same module in one process,
fp32, 5 steps: every step's loss within 1e-5 relative and the parameter vector within
1e-5 relative (as in test_tensor.py). The fast tier runs cp=2 on the reference model,
cp x dp with ZeRO-3, the hybrid mode at cp=4, all-to-all inside pipeline stages and hybrid
with expert parallelism (those four in one 4-process launch) and Hugging Face Llama at cp=2;
the rest is slow or extended: all-to-all and hybrid with tp+SP, pp, ep and ZeRO-3, and with
FP8 against one process under the same recipe.
"""

import json

import pytest
import torch

from hf_support import hf_reference_run
from reference import reference_run
from tests_support import (BATCH_SIZE, LOSS_RTOL, LayoutRuns, PARAM_RTOL, SCRIPTS, assert_equivalent, relative,
                           run_distributed, selected_cases)

STEPS = 5
FP8_STEP_RTOL = 0.01  # FP8 per step against one process under the same recipe (see the FP8 test)


# (nproc, cp, tp, sp, zero, accumulate, clip, extra script args): the reference model
HYBRID = ("--cp-mode", "hybrid", "--cp-ulysses", "2")  # Ulysses pairs x ring of 2
ALLTOALL = ("--cp-mode", "alltoall")
PP2 = ("--pp", "2", "--microbatches", "2", "--batch-size", "4")  # one block per stage, 2 microbatches of 2
MOE_EP2 = ("--model", "tiny_moe", "--ep", "2")  # ep=2 taken from the cp ranks
REFERENCE_FAST = [
    (2, 2, 1, False, 1, 1, None, ("--ac", "full")),  # recomputation in backward goes through the ring too
    (4, 2, 1, False, 3, 1, None, ()),  # cp x dp_shard=2 with ZeRO-3
    (4, 4, 1, False, 1, 1, None, HYBRID),  # cp > kv heads
    # the all-to-all and hybrid modes composed: in the same 4-process launch as the two above
    (4, 2, 1, False, 1, 1, None, (*ALLTOALL, *PP2)),  # Ulysses inside each pipeline stage
    (4, 4, 1, False, 1, 1, None, (*HYBRID, *MOE_EP2)),  # experts dispatched over hybrid cp ranks
]
REFERENCE_FULL = [
    (2, 2, 1, False, 1, 2, 0.5, ()),
    (4, 4, 1, False, 1, 1, None, ()),
    (4, 4, 1, False, 2, 1, None, ("--cp-mode", "allgather")),
    (2, 2, 1, False, 0, 1, None, ("--cp-sharding", "contiguous")),
    (4, 2, 2, True, 1, 1, None, ()),  # cp x tp with sequence parallelism
    (4, 2, 2, False, 3, 1, None, ()),  # cp x tp, FSDP2 over cp
    (4, 2, 1, False, 1, 2, 0.5, ()),  # cp x dp, gradient accumulation and clipping
    (2, 2, 1, False, 1, 1, None, ("--cp-mode", "alltoall")),  # Ulysses
    (4, 2, 2, True, 1, 1, None, ("--cp-mode", "alltoall")),  # Ulysses x tp+SP: heads/tp shard over cp
    (4, 2, 1, False, 3, 1, None, ("--cp-mode", "alltoall", "--cp-sharding", "contiguous")),
]
# hybrid and all-to-all beyond the fast cases: contiguous sharding, and each composed with tp, pp, ep and ZeRO-3
REFERENCE_EXTENDED = [
    (4, 4, 1, False, 1, 1, None, (*HYBRID, "--cp-sharding", "contiguous")),
    (8, 4, 1, False, 3, 1, None, HYBRID),  # cp x dp_shard=2 with ZeRO-3
    (8, 4, 2, True, 1, 1, None, (*HYBRID, "--model", "tiny_kv4")),  # x tp+SP: 2 q and 2 kv heads per tp rank
    (8, 4, 1, False, 1, 1, None, (*HYBRID, *PP2)),
    (4, 4, 1, False, 3, 1, None, (*HYBRID, *MOE_EP2)),  # experts sharded by FSDP2 over the cp ranks
    (2, 2, 1, False, 1, 1, None, (*ALLTOALL, *MOE_EP2)),
    (4, 2, 1, False, 3, 1, None, (*ALLTOALL, *MOE_EP2)),  # cp x dp_shard=2, ep=2, ZeRO-3
    (8, 2, 2, True, 1, 1, None, (*ALLTOALL, *PP2, "--model", "tiny_kv4")),  # cp x tp+SP x pp
]
REF_PARAMS = "nproc,cp,tp,sp,zero,accumulate,clip,extra"


# FP8 with the all-to-all and hybrid modes, against one process under the same recipe: (nproc, cp, recipe, extra)
FP8 = [
    (2, 2, "tensorwise", ALLTOALL),
    (2, 2, "rowwise", ALLTOALL),
    (4, 4, "tensorwise", HYBRID),
    (4, 4, "rowwise", HYBRID),
]
FP8_PARAMS = "nproc,cp,recipe,extra"


def layout_case(test_name: str, params: dict):
    if test_name == "test_fp8_with_other_modes_tracks_one_process":
        nproc, cp, recipe, extra = (params[name] for name in FP8_PARAMS.split(","))
        precision = f"fp8-{recipe}"
        return {
            ("fp8", nproc, cp, recipe, extra): (nproc, dict(zero=1, steps=STEPS, precision=precision, cp=cp,
                                                            extra=extra)),
            ("fp8-one", recipe): (1, dict(zero=0, steps=STEPS, precision=precision)),
        }
    if not test_name.startswith("test_reference_model_matches_single_process"):
        return None
    key = tuple(params[name] for name in REF_PARAMS.split(","))
    nproc, cp, tp, sp, zero, accumulate, clip, extra = key
    return key, (nproc, dict(zero=zero, accumulate=accumulate, clip=clip, steps=STEPS, tp=tp, sp=sp, cp=cp, extra=extra))


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Every selected reference-model case of this module, trained in one launch per process count."""
    return LayoutRuns(tmp_path_factory.mktemp("context"), selected_cases(request, layout_case))


def option(extra: tuple, flag: str, default):
    """The value after ``flag`` in a case's train_llama.py arguments."""
    return extra[extra.index(flag) + 1] if flag in extra else default


def check_reference(runs, nproc, cp, tp, sp, zero, accumulate, clip, extra):
    result, params = runs[(nproc, cp, tp, sp, zero, accumulate, clip, extra)]
    layout = result["layout"]
    pp, ep = int(option(extra, "--pp", 1)), int(option(extra, "--ep", 1))
    assert (layout["cp"], layout["tp"], layout["pp"], layout["ep"]) == (cp, tp, pp, ep)
    model, batch = option(extra, "--model", "tiny"), int(option(extra, "--batch-size", BATCH_SIZE))
    ref_losses, ref_params = reference_run(STEPS, nproc // (cp * tp * pp), accumulate, clip, model=model,
                                           batch_size=batch)  # fmt: skip
    assert_equivalent(result["losses"], params, ref_losses, ref_params)
    if pp > 1:  # the step runs per microbatch on the last stage; its logging is test_pipeline.py's
        return
    # What the unchanged training_step logged is its data rank's whole-sequence loss, identical on
    # the cp (and tp) ranks that share those sequences; ranks are data-rank major (pp, dp, cp, tp).
    logged = [r["logged_train_loss"] for r in result["model_state_bytes"]]
    per_data_rank = [logged[i : i + cp * tp] for i in range(0, nproc, cp * tp)]
    assert all(len(set(group)) == 1 for group in per_data_rank), f"cp/tp peers logged different values: {logged}"
    mean = sum(group[0] for group in per_data_rank) / len(per_data_rank)
    assert mean == pytest.approx(ref_losses[-1], rel=LOSS_RTOL)


@pytest.mark.distributed
@pytest.mark.timeout(900)  # the first case of a process count trains its whole batch
@pytest.mark.parametrize(REF_PARAMS, REFERENCE_FAST)
def test_reference_model_matches_single_process(runs, nproc, cp, tp, sp, zero, accumulate, clip, extra):
    check_reference(runs, nproc, cp, tp, sp, zero, accumulate, clip, extra)


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    REF_PARAMS,
    [pytest.param(*case, marks=pytest.mark.slow) for case in REFERENCE_FULL]
    + [pytest.param(*case, marks=pytest.mark.extended) for case in REFERENCE_EXTENDED],
)
def test_reference_model_matches_single_process_full(runs, nproc, cp, tp, sp, zero, accumulate, clip, extra):
    check_reference(runs, nproc, cp, tp, sp, zero, accumulate, clip, extra)


@pytest.mark.distributed
@pytest.mark.extended
@pytest.mark.timeout(400)
def test_hybrid_attention_sends_the_bytes_the_planner_predicts():
    """cp=4, Ulysses pairs x ring of 2: the sends and all-to-alls of a step within 5% of the formula."""
    from benchmarks.cp_bytes_vs_theory import measure_mode, row_ratio

    row = measure_mode("hybrid", "hybrid", 2)
    assert row["ranks_agree"]
    assert {op: m["group_sizes"] for op, m in row["measured"].items()} == {"all_to_all": [2], "send": [2]}
    assert 0.95 <= row_ratio(row) <= 1.05, row


@pytest.mark.distributed
@pytest.mark.extended
@pytest.mark.timeout(900)
@pytest.mark.parametrize(FP8_PARAMS, FP8)
def test_fp8_with_other_modes_tracks_one_process(runs, nproc, cp, recipe, extra):
    """FP8 scales come from each rank's own tokens (its sequence shard), so a cp run quantizes
    other groups of values than one process does: compared per step within FP8_STEP_RTOL, as the
    5D layout's FP8 run is (test_five_d.py)."""
    result, _ = runs[("fp8", nproc, cp, recipe, extra)]
    one, _ = runs[("fp8-one", recipe)]
    assert result["layout"]["cp"] == cp
    rel = relative(result["losses"], one["losses"])
    print(f"fp8-{recipe} {' '.join(extra)} cp={cp}: max per-step loss difference to one process {rel:.2e}")
    assert rel < FP8_STEP_RTOL, (result["losses"], one["losses"])


# (nproc, cp, tp, sp, zero): Hugging Face LlamaForCausalLM in the obvious LightningModule
HF_FAST = [(2, 2, 1, False, 1)]
HF_FULL = [(4, 4, 1, False, 1), (4, 2, 2, True, 1), (4, 2, 1, False, 3), (2, 2, 1, False, 1, "allgather"),
           (2, 2, 1, False, 1, "alltoall")]  # fmt: skip
HF_PARAMS = "nproc,cp,tp,sp,zero"


def check_hf(tmp_path, nproc, cp, tp, sp, zero, mode="ring"):
    pytest.importorskip("transformers")
    args = ["--model", "llama", "--cp", str(cp), "--cp-mode", mode, "--tp", str(tp), "--zero", str(zero),
            "--steps", str(STEPS), "--out", str(tmp_path), *(["--sp"] if sp else [])]  # fmt: skip
    run_distributed(SCRIPTS / "train_hf.py", nproc, args, timeout=240).check()
    losses = json.loads((tmp_path / "result.json").read_text())["losses"]
    ref_losses, ref_params = hf_reference_run("llama", STEPS, nproc // (cp * tp))
    assert_equivalent(losses, torch.load(tmp_path / "params.pt"), ref_losses, ref_params)


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(HF_PARAMS, HF_FAST)
def test_hugging_face_llama_matches_single_process(tmp_path, nproc, cp, tp, sp, zero):
    check_hf(tmp_path, nproc, cp, tp, sp, zero)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", HF_FULL, ids=str)
def test_hugging_face_llama_matches_single_process_full(tmp_path, case):
    check_hf(tmp_path, *case)


@pytest.mark.distributed
@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", ["rope_cache", "hidden_cache", pytest.param("manual", marks=pytest.mark.slow)])
def test_model_with_a_length_sliced_rope_cache_matches_single_process(tmp_path, case):
    """rope_cache: positions through a RoPE cache sliced by length. hidden_cache: the slice made
    inside the rotary module from the hidden states' length (observed, not passed). manual: the
    rope_cache model under manual optimization, two backward passes and a self.log after each
    inside one step."""
    out = tmp_path / "result.json"
    run_distributed(SCRIPTS / "cp_cases.py", 2, ["--case", case, "--out", str(out)], timeout=150).check()
    result = json.loads(out.read_text())
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(result["ref_losses"]), rtol=1e-5, atol=0)
    assert result["param_error"] <= PARAM_RTOL


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_second_hugging_face_model_gets_global_positions_too(tmp_path):
    """A frozen reference model next to the policy (DPO, distillation): its logits on the shard
    equal its full-sequence logits at the shard's positions."""
    pytest.importorskip("transformers")
    run = run_distributed(SCRIPTS / "cp_cases.py", 2, ["--case", "hf_two_models"], timeout=150).check()
    assert run.output.count("REFERENCE MATCHES") == 2


# ---------------------------------------------------------------- per-rank work and memory
def probe(tmp_path, cp, sharding="zigzag"):
    out = tmp_path / f"probe_{cp}_{sharding}.json"
    args = ["--sharding", sharding, "--seq", "128", "--out", str(out)]
    run_distributed(SCRIPTS / "cp_attention_probe.py", cp, args, timeout=150).check()
    return json.loads(out.read_text())["per_rank"]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_attention_activations_fall_by_cp_and_zigzag_balances_work(tmp_path):
    measured = {cp: probe(tmp_path, cp) for cp in (1, 2, 4)}
    full = measured[1][0]["attention_bytes"]
    for cp in (2, 4):
        per_rank = [r["attention_bytes"] for r in measured[cp]]
        for value in per_rank:  # fixed global sequence: each rank saves 1/cp of it
            assert value / full == pytest.approx(1 / cp, rel=0.05), (cp, per_rank, full)
        work = [(r["stats"]["forward_units"], r["stats"]["backward_units"]) for r in measured[cp]]
        assert len(set(work)) == 1, f"zig-zag work differs between ranks: {work}"
    contiguous = [r["stats"]["forward_units"] for r in probe(tmp_path, 4, "contiguous")]
    assert contiguous == sorted(contiguous) and len(set(contiguous)) == 4, contiguous  # rank r: r+1 blocks
    assert sum(contiguous) == sum(r["stats"]["forward_units"] for r in measured[4])  # same total work


# ---------------------------------------------------------------- bad input
@pytest.mark.distributed
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "case, message",
    [
        ("no_positions", "takes no position_ids, no rotary module with a seq_len argument was found, and the probe could not show"),
        pytest.param("explicit_softmax", "computes softmax(QKᵀ)V itself, which ring attention cannot replace", marks=pytest.mark.slow),
        ("unlabelled", "carries no labels"),
        pytest.param("bad_seq", "sequence length 30 is not divisible by 2*cp=4", marks=pytest.mark.slow),
        pytest.param("hf_positional_mask", "the attention_mask passed to model masks tokens", marks=pytest.mark.slow),
    ],
)
def test_what_cp_cannot_run_fails_before_any_optimizer_step(case, message):
    run = run_distributed(SCRIPTS / "cp_cases.py", 2, ["--case", case], timeout=150)
    assert run.returncode != 0
    assert message in run.output, run.output[-3000:]
    assert "OPTIMIZER STEP RAN" not in run.output

"""Expert parallelism of unchanged MoE models: training equivalence, dispatch accounting, capacity.

Each run trains under FiveDStrategy(ep=...) and the same module in one process, fp32,
dropless, 5 steps: every step's loss within 1e-5 relative and the parameter vector within
1e-5 relative (full parameters gathered over ep).
"""

import json
import math

import pytest
import torch

from hf_support import hf_reference_run
from reference import reference_run
from tests_support import SCRIPTS, assert_equivalent, parameter_vector_error, run_distributed, run_layout

STEPS = 5


def check_reference(tmp_path, nproc, ep, zero=1, tp=1, clip=None, extra=(), aux_loss_coef=0.0, pp=1, batch_size=2):
    result, params = run_layout(
        tmp_path, nproc, zero=zero, steps=STEPS, tp=tp, clip=clip, model="tiny_moe", extra=["--ep", str(ep), *extra]
    )
    assert (result["layout"]["tp"], result["layout"]["pp"]) == (tp, pp)
    data_ranks = nproc // (tp * pp)
    ref_losses, ref_params = reference_run(
        STEPS, data_ranks, clip=clip, model="tiny_moe", aux_loss_coef=aux_loss_coef, batch_size=batch_size
    )
    assert_equivalent(result["losses"], params, ref_losses, ref_params)
    return params


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("ep,zero", [(2, 1), pytest.param(4, 0, marks=pytest.mark.slow)])
def test_expert_parallel_matches_single_process(tmp_path, ep, zero):
    check_reference(tmp_path, ep, ep, zero=zero)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_expert_parallel_with_zero3_and_data_parallel(tmp_path):
    # ep=2 borrowed from dp_shard=4: two ranks hold each expert, sharded over them by FSDP2.
    check_reference(tmp_path, 4, 2, zero=3)


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("nproc,ep,dp_replicate", [
    (2, 2, 1),  # ep = dp_shard: each expert on one rank of its ZeRO-3 shard group
    pytest.param(4, 4, 1, marks=pytest.mark.extended),
    pytest.param(4, 2, 2, marks=pytest.mark.extended),  # HSDP: one shard rank, two replicas
])  # fmt: skip
def test_expert_parallel_zero3_with_one_rank_per_expert_shard_group(tmp_path, nproc, ep, dp_replicate):
    """FSDP2 (torch 2.13) on a one-rank shard group with a forced sum divided expert gradients by
    dp x cp twice (3.4e-4 parameter error over 4 ranks, hidden by Adam); each expert unit now
    forces the sum only where a reduce-scatter runs (parallel/data/fsdp.py)."""
    result, params = run_layout(tmp_path, nproc, zero=3, dp_replicate=dp_replicate, steps=STEPS, model="tiny_moe",
                                extra=["--ep", str(ep)])  # fmt: skip
    ref_losses, ref_params = reference_run(STEPS, nproc, model="tiny_moe")
    assert_equivalent(result["losses"], params, ref_losses, ref_params)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_expert_parallel_with_tensor_parallel_and_clipping(tmp_path):
    check_reference(tmp_path, 4, 2, zero=1, tp=2, clip=0.05)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_expert_parallel_inside_pipeline_stages(tmp_path):
    pipeline = ["--pp", "2", "--microbatches", "2", "--batch-size", "4"]
    check_reference(tmp_path, 4, 2, extra=pipeline, pp=2, batch_size=4)


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("nproc,ep", [(1, 1), (2, 2)])
def test_aux_loss_gradient_is_the_one_process_whole_batch_loss(tmp_path, nproc, ep):
    # Switch loss with counts over the whole batch: the ranks' mean gradient is one process's.
    # At ep=1 the dispatch still runs (load balancing asks for it), with every expert local.
    params = check_reference(tmp_path, nproc, ep, zero=2, extra=["--balancing", "aux_loss"], aux_loss_coef=0.01)
    _, plain = reference_run(STEPS, nproc, model="tiny_moe")
    assert parameter_vector_error(params, plain) > 1e-4  # the aux term did change the training


def check_hf(tmp_path, name, nproc, ep, zero=1, tp=1):
    pytest.importorskip("transformers")
    args = ["--model", name, "--ep", str(ep), "--zero", str(zero), "--tp", str(tp), "--steps", str(STEPS),
            "--out", str(tmp_path)]  # fmt: skip
    run_distributed(SCRIPTS / "train_hf.py", nproc, args, timeout=300).check()
    result = json.loads((tmp_path / "result.json").read_text())
    params = torch.load(tmp_path / "params.pt")
    ref_losses, ref_params = hf_reference_run(name, STEPS, nproc // tp)
    assert_equivalent(result["losses"], params, ref_losses, ref_params)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_mixtral_matches_single_process(tmp_path):
    check_hf(tmp_path, "mixtral", 2, 2)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "name,nproc,ep,zero,tp",
    [("mixtral", 4, 4, 1, 1), ("mixtral", 4, 2, 3, 1), ("mixtral", 4, 2, 1, 2), ("qwen2_moe", 2, 2, 1, 1)],
    ids=["mixtral-ep4", "mixtral-ep2-zero3-dp4", "mixtral-ep2-tp2", "qwen2_moe-ep2"],
)
def test_hugging_face_moe_layouts(tmp_path, name, nproc, ep, zero, tp):
    check_hf(tmp_path, name, nproc, ep, zero=zero, tp=tp)


def dispatch_records(tmp_path, *extra):
    out = tmp_path / "dispatch.json"
    run_distributed(SCRIPTS / "expert_dispatch_check.py", 2, ["--out", str(out), *extra], timeout=120).check()
    return json.loads(out.read_text())


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_all_to_all_splits_follow_the_router_and_bytes_are_tokens_topk_hidden(tmp_path):
    records = dispatch_records(tmp_path)
    for record in records:
        row = record["hidden"] * record["element_bytes"]
        for i, layer in enumerate(record["layers"]):
            # What each rank sends to each owner is what its router assigned to that owner's experts.
            assert layer["send_splits"] == layer["router_by_owner"]
            assert layer["tokens_per_expert"] == layer["router_per_expert"]
            assert sum(layer["send_splits"]) == layer["tokens"] * record["top_k"]
            # What a rank receives from each source is what that source sent it.
            assert layer["recv_splits"] == [r["layers"][i]["send_splits"][record["rank"]] for r in records]
            # Forward: a count exchange, then dispatch (T*k rows out) and combine (the received rows back).
            count, dispatch, combine = record["forward_a2a"][3 * i : 3 * i + 3]
            assert count == record["num_experts"] * 8
            assert dispatch == layer["tokens"] * record["top_k"] * row
            assert combine == sum(layer["recv_splits"]) * row
        # Backward runs the two data all-to-alls of every layer again, in reverse.
        layers = len(record["layers"])
        assert len(record["forward_a2a"]) == 3 * layers and len(record["backward_a2a"]) == 2 * layers
    tokens = sum(layer["tokens"] for r in records for layer in r["layers"])
    moved = sum(
        sum(r["forward_a2a"]) - 8 * r["num_experts"] * len(r["layers"]) + sum(r["backward_a2a"]) for r in records
    )
    row = records[0]["hidden"] * records[0]["element_bytes"]
    assert moved == 4 * tokens * records[0]["top_k"] * row  # dispatch + combine, forward + backward


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("policy", ["probability", pytest.param("position", marks=pytest.mark.slow)])
def test_capacity_drops_are_counted_and_kept_tokens_match(tmp_path, policy):
    records = dispatch_records(tmp_path, "--capacity-factor", "0.5", "--drop-policy", policy)
    dropped = sum(layer["dropped"] for r in records for layer in r["layers"])
    assert dropped > 0
    for record in records:
        assert record["step_dropped"] == dropped  # the logged count sums every rank and layer
        for layer in record["layers"]:
            cap = math.ceil(0.5 * layer["tokens"] * record["top_k"] / record["num_experts"])
            kept = layer["kept_per_expert"]
            assert all(n <= cap for n in kept) and all(n <= t for n, t in zip(kept, layer["tokens_per_expert"]))
            assert sum(kept) == sum(layer["tokens_per_expert"]) - layer["dropped"] == sum(layer["send_splits"])
            assert layer["kept_tokens"] > 0
            assert layer["kept_max_error"] <= 1e-6 * max(layer["kept_scale"], 1e-3)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_aux_loss_free_bias_moves_by_the_rate_and_is_saved(tmp_path):
    _, params = run_layout(
        tmp_path, 2, zero=1, steps=STEPS, model="tiny_moe", extra=["--ep", "2", "--balancing", "bias"]
    )
    biases = {k: v for k, v in params.items() if k.endswith("router.expert_bias")}
    assert len(biases) == 2  # one per MoE layer, in the gathered (checkpointed) state
    for bias in biases.values():
        steps = bias / 0.001  # DeepSeek-V3's rate: each optimizer step moves every expert by +-rate or 0
        assert torch.allclose(steps, steps.round(), atol=1e-4) and steps.abs().max() <= STEPS
        assert steps.abs().sum() > 0

"""Layout search: what it enumerates, what it keeps, how it ranks, and choose_layout for strategy="5d"."""

import pytest

from lightning_5d.config import IMPLEMENTED_DIMS, LayoutError
from lightning_5d.estimate import (
    GIB,
    Cluster,
    Link,
    NoLayoutFitsError,
    choose_layout,
    enumerate_setups,
    estimate,
    get_preset,
    plan,
    predict_step_time,
)
from lightning_5d.estimate.comm import group_link

L8B = get_preset("llama3-8b")
CLUSTER_64 = Cluster(gpus=64, gpu_memory_gib=80, gpus_per_node=8)


@pytest.fixture(scope="module")
def plan_8b():
    return plan(L8B, CLUSTER_64, seq_len=4096, global_batch=1024)


def test_top_choice_for_8b_on_64_gpus(plan_8b):
    top = plan_8b[0]
    assert top.fits and top.estimate.memory.total <= CLUSTER_64.usable_memory_bytes
    assert top.setup.world_size == 64 and top.setup.global_batch == 1024
    assert top.setup.tp <= 8
    assert top.why and "fits" in top.why


def test_no_plan_entry_puts_tp_across_nodes(plan_8b):
    for entry in plan_8b:
        assert entry.setup.tp <= 8
        assert group_link(entry.setup, ("tp",), 8) == Link.INTRA


def test_plan_is_ranked_by_step_time_and_all_fit(plan_8b):
    times = [float(f"{e.time.total:.4g}") for e in plan_8b]  # compared as printed (ranking.py)
    assert times == sorted(times)
    assert all(e.fits for e in plan_8b)
    assert [e.rank for e in plan_8b] == list(range(1, len(plan_8b) + 1))


def test_70b_needs_model_parallelism_and_keeps_tp_in_a_node():
    entries = plan(
        "llama3-70b", CLUSTER_64, seq_len=4096, global_batch=256, available_dims={"dp", "tp"}, top=3
    )
    top = entries[0]
    assert top.setup.tp > 1 or top.setup.zero == 3
    assert top.setup.tp <= 8
    assert top.estimate.memory.total / GIB < 80


def test_recompute_is_used_only_when_needed():
    # 8B with 32k tokens per sequence on 8 GPUs, data parallel only: activations force recomputation.
    entries = plan(L8B, Cluster(gpus=8), seq_len=32768, global_batch=8, available_dims={"dp"}, top=1)
    assert entries[0].setup.recompute.value in ("selective", "full")
    entries = plan(L8B, Cluster(gpus=8), seq_len=1024, global_batch=64, available_dims={"dp"}, top=1)
    assert entries[0].setup.recompute.value == "none"


def test_enumeration_respects_divisibility():
    spec = get_preset("l5d-tiny")
    setups = list(enumerate_setups(spec, 16, seq_len=256, global_batch=64))
    assert setups
    for s in setups:
        assert s.world_size == 16
        assert spec.num_heads % s.tp == 0 and spec.num_layers % (s.pp * s.v) == 0
        assert s.cp == 1 or 256 % (2 * s.cp) == 0
        assert s.global_batch == 64


def test_moe_plans_use_ep_only_with_experts_dividing():
    setups = list(enumerate_setups(get_preset("l5d-tiny-moe"), 8, seq_len=256, global_batch=32))
    eps = {s.ep for s in setups}
    assert eps == {1, 2, 4}


def test_nothing_fits_names_the_smallest_layout():
    with pytest.raises(NoLayoutFitsError, match=r"llama3-70b.*smallest .*GiB.*enable"):
        plan("llama3-70b", Cluster(gpus=8), seq_len=4096, global_batch=8, available_dims={"dp"})


def test_include_unfit_returns_ranked_unfit_layouts():
    entries = plan(
        "llama3-70b", Cluster(gpus=8), seq_len=4096, global_batch=8, available_dims={"dp"}, include_unfit=True
    )
    assert entries and not any(e.fits for e in entries) and "does NOT fit" in entries[0].why


def test_choose_layout_uses_only_available_dims():
    layout = choose_layout("l5d-tiny", 4, available_dims=IMPLEMENTED_DIMS)
    assert set(layout) == {"dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "zero"}
    assert layout["tp"] == layout["pp"] == layout["cp"] == layout["ep"] == 1
    assert layout["dp_replicate"] * layout["dp_shard"] == 4
    layout = choose_layout("l5d-tiny", 4, available_dims={"dp_shard"})
    assert layout["dp_shard"] == 4 and layout["dp_replicate"] == 1


def test_choose_layout_for_a_big_model_shards():
    layout = choose_layout(L8B, 8, available_dims={"dp_replicate", "dp_shard"}, seq_len=4096)
    assert layout["dp_shard"] > 1 and layout["zero"] >= 1  # 16 bytes/param of 8B do not fit unsharded


def test_choose_layout_rejects_unknown_dims():
    with pytest.raises(LayoutError, match="unknown dimension"):
        choose_layout("l5d-tiny", 2, available_dims={"dq"})


def test_step_time_parts():
    est = estimate(L8B, tp=8, pp=2, dp_shard=4, zero=1, seq_len=4096, microbatches=8)
    t = predict_step_time(est, CLUSTER_64)
    assert t.bubble == pytest.approx(t.compute * est.bubble_relative)
    assert t.exposed["tp"] == pytest.approx(t.comm["tp"])  # tp is on the critical path
    assert 0 < t.exposed["dp"] < t.comm["dp"]  # ZeRO-1: the reduce-scatter hides, the post-step all-gather does not
    assert t.total >= t.compute + t.bubble
    assert 0 < t.predicted_mfu <= CLUSTER_64.compute_efficiency


def test_top_ten_of_the_documented_case_has_no_exact_ties(plan_8b):
    # `l5d plan --model llama3-8b --gpus 64 --gpu-mem 80 --gpus-per-node 8` (issue 26): every row
    # beats the next on a prediction, not on the layout's name.
    for entry in plan_8b[:10]:
        assert entry.ahead_because and not entry.ahead_because.startswith(("no prediction", "identical"))
    assert plan_8b[-1].ahead_because == ""


@pytest.mark.slow
def test_top_ten_of_the_documented_mixtral_case_has_no_exact_ties():
    # docs/planner.md: `l5d plan --model mixtral-8x7b --gpus 32 --global-batch 512`
    entries = plan("mixtral-8x7b", Cluster(gpus=32), seq_len=4096, global_batch=512, top=10)
    assert len(entries) == 10
    for entry in entries:
        assert entry.ahead_because and not entry.ahead_because.startswith(("no prediction", "identical"))

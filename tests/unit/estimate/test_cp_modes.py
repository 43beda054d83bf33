"""The planner's choice of how attention crosses the cp ranks (ring, allgather, alltoall, hybrid)."""

from dataclasses import replace

from lightning_5d.config import ContextParallelMode
from lightning_5d.estimate import Cluster, estimate, get_preset, plan
from lightning_5d.estimate.search import cp_modes

L8B = get_preset("llama3-8b")  # 32 query, 8 KV heads
MHA = replace(L8B, num_kv_heads=L8B.num_heads, name="8b-mha")  # K/V as large as Q: all-to-all's best case
FEW_HEADS = replace(L8B, num_heads=4, num_kv_heads=4, name="8b-4-heads")  # cp=8 exceeds the heads
NARROW = dict(micro_batch_sizes=(1,), zero_stages=(1,))  # one data split per cp size: milliseconds
SLOW = dict(gpu_memory_gib=80, gpus_per_node=1, inter_node_bandwidth=5e9)  # every cp byte crosses a slow link


def _cp_rows(entries, cp):
    rows = [e for e in entries if e.setup.cp == cp]
    assert rows, f"no cp={cp} layout in the plan"
    return rows


def _modes(spec, cp, tp=1):
    return [s.cp_mode_text for s in cp_modes(spec, estimate(spec, cp=cp, tp=tp, seq_len=8192).setup)]


def test_modes_follow_the_heads():
    assert _modes(L8B, cp=8) == ["ring", "allgather", "alltoall", "hybrid(a2a=2,ring=4)", "hybrid(a2a=4,ring=2)"]
    assert _modes(L8B, cp=8, tp=4) == ["ring", "allgather", "hybrid(a2a=2,ring=4)"]  # 2 KV heads per tp rank
    assert _modes(FEW_HEADS, cp=8) == ["ring", "allgather", "hybrid(a2a=2,ring=4)", "hybrid(a2a=4,ring=2)"]


def test_hybrid_bytes_are_the_alltoall_over_the_group_plus_the_ring_over_the_groups():
    cp, u = 8, 2
    hybrid = estimate(L8B, cp=cp, seq_len=8192, cp_mode="hybrid", cp_ulysses=u).comm
    a2a = {c.what: c for c in estimate(L8B, cp=cp, seq_len=8192, cp_mode="alltoall").comm if c.dim == "cp"}
    ring_cp = {c.what: c for c in estimate(L8B, cp=cp, seq_len=8192).comm if c.dim == "cp"}["ring K/V, dK/dV"]
    ring_r = {c.what: c for c in estimate(L8B, cp=cp // u, seq_len=8192).comm if c.dim == "cp"}["ring K/V, dK/dV"]
    by_what = {c.what: c for c in hybrid if c.dim == "cp"}
    assert by_what["all-to-all q, out (Ulysses)"].group_size == u
    assert by_what["all-to-all q, out (Ulysses)"].bytes_per_call == a2a["all-to-all q, out (Ulysses)"].bytes_per_call
    # the ring over cp/u groups: a cp/u ring's hops, each a block of u·s positions x h_kv/u heads (the local block)
    hops = by_what["ring K/V, dK/dV"]
    assert (hops.group_size, hops.calls, hops.bytes_per_call) == (cp // u, ring_r.calls, ring_cp.bytes_per_call)


def test_plan_picks_alltoall_when_heads_allow_and_cp_traffic_is_exposed():
    entries = plan(MHA, Cluster(gpus=4, **SLOW), seq_len=16384, available_dims={"cp"}, top=None, **NARROW)
    for row in _cp_rows(entries, 4):
        assert row.setup.cp_mode is ContextParallelMode.ALL_TO_ALL
        assert "attention over cp as alltoall" in row.why and "vs ring" in row.why
        assert "cp=4 alltoall" in row.setup.describe()
        assert row.layout()["context"] == {"mode": "alltoall"}


def test_plan_picks_ring_when_its_hops_hide_behind_attention():
    fast = Cluster(gpus=4, gpu_memory_gib=80, gpus_per_node=4)
    entries = plan(MHA, fast, seq_len=131072, available_dims={"cp"}, top=None, micro_batch_sizes=(1,), zero_stages=(3,))
    for row in _cp_rows(entries, 4):
        assert row.setup.cp_mode is ContextParallelMode.RING
        assert "ring" in row.why and "(cp exposed 0 ms)" in row.why


def test_plan_uses_ring_or_hybrid_when_cp_exceeds_the_heads():
    entries = plan(FEW_HEADS, Cluster(gpus=8, **SLOW), seq_len=16384, available_dims={"cp"}, top=None, **NARROW)
    rows = _cp_rows(entries, 8)
    for row in rows:
        assert row.setup.cp_mode in (ContextParallelMode.RING, ContextParallelMode.HYBRID)
        assert "alltoall impossible: cp=8 does not divide 4 query / 4 KV heads per tp rank" in row.why
    # exposed traffic: the all-to-all inside groups of 4 cuts the ring's hops, so hybrid wins
    assert any(row.setup.cp_mode is ContextParallelMode.HYBRID for row in rows)
    hybrid = next(row for row in rows if row.setup.cp_mode is ContextParallelMode.HYBRID)
    assert hybrid.layout()["context"] == {"mode": "hybrid", "ulysses": hybrid.setup.cp_ulysses}
    assert "hybrid(a2a=" in hybrid.setup.describe()

"""Communication per step: the playbook's 2Psi / 3Psi accounting and the per-layer TP, CP, PP, EP traffic."""

import pytest

from lightning_5d.config import LayoutError
from lightning_5d.estimate import Collective, Link, estimate, get_preset, ring_bytes

L8B = get_preset("llama3-8b")
MIXTRAL = get_preset("mixtral-8x7b")
N = 64


def dp_bytes(zero, **fields):
    est = estimate(L8B, dp_shard=N, zero=zero, seq_len=1024, **fields)
    return est.comm_bytes_per_step["dp"], est.rank_params.total


def test_ring_factors():
    assert ring_bytes(Collective.ALL_REDUCE, 100, 4) == 150
    assert ring_bytes(Collective.ALL_GATHER, 100, 4) == ring_bytes(Collective.REDUCE_SCATTER, 100, 4) == 75
    assert ring_bytes(Collective.SEND_RECV, 100, 4) == 100


def test_dp_allreduce_is_2psi_and_zero12_match_it():
    z0, psi = dp_bytes(0)
    ring = (N - 1) / N
    assert z0 == pytest.approx(2 * ring * psi * 2)  # 2Psi elements of 2 bytes
    assert dp_bytes(1)[0] == pytest.approx(z0)  # reduce-scatter + all-gather
    assert dp_bytes(2)[0] == pytest.approx(z0)  # one microbatch: same as ZeRO-1


def test_zero3_is_3psi():
    z3, psi = dp_bytes(3)
    assert z3 == pytest.approx(3 * (N - 1) / N * psi * 2)


def test_zero2_reduces_every_microbatch_zero1_once():
    z1, psi = dp_bytes(1, grad_accum=4)
    z2, _ = dp_bytes(2, grad_accum=4)
    ring = (N - 1) / N * psi * 2
    assert z1 == pytest.approx(2 * ring)
    assert z2 == pytest.approx(4 * ring + ring)


def test_fp32_grad_accumulation_reduces_fp32_grads():
    z0, psi = dp_bytes(0, fp32_grad_accumulation=True)
    assert z0 == pytest.approx(2 * (N - 1) / N * psi * 4)


def test_hsdp_adds_an_all_reduce_of_the_shard_across_replicas():
    est = estimate(L8B, dp_replicate=8, dp_shard=8, zero=1, seq_len=1024)
    across = [c for c in est.comm if c.group_size == 8 and c.collective == Collective.ALL_REDUCE]
    assert len(across) == 1 and across[0].link == Link.INTER
    shard = [c for c in est.comm if c.collective == Collective.REDUCE_SCATTER][0]
    assert shard.link == Link.INTRA  # dp_shard=8 of tp=1 ranks fills exactly one node
    assert across[0].bytes_per_call == pytest.approx(shard.bytes_per_call / 8)


@pytest.mark.parametrize("sp", [False, True])
def test_tp_moves_four_allreduce_volumes_per_layer(sp):
    t, s, M = 8, 4096, 2
    est = estimate(L8B, tp=t, sequence_parallel=sp, seq_len=s, grad_accum=M)
    per_layer = [c for c in est.comm if c.dim == "tp" and "block" in c.what.lower()]
    act = 2 * s * L8B.hidden_size
    expected = 4 * ring_bytes(Collective.ALL_REDUCE, act, t) * L8B.num_layers * M
    assert sum(c.bytes_per_rank for c in per_layer) == pytest.approx(expected)
    assert sum(c.calls for c in per_layer) == (8 if sp else 4) * L8B.num_layers * M
    assert all(c.link == Link.INTRA for c in per_layer)


def test_full_recompute_replays_forward_collectives():
    base = estimate(L8B, tp=8, seq_len=4096).comm_bytes_per_step["tp"]
    full = estimate(L8B, tp=8, seq_len=4096, recompute="full").comm_bytes_per_step["tp"]
    assert 1.4 < full / base < 1.5  # blocks: 6 collectives instead of 4, plus unchanged embedding/head


def test_cp_ring_passes_kv_twice_and_returns_gradients_to_their_owners():
    cp, s = 4, 8192
    est = estimate(L8B, cp=cp, seq_len=s)
    (ring,) = [c for c in est.comm if c.dim == "cp"]
    kv_block = 2 * 2 * (s // cp) * L8B.d_head * L8B.kv_heads  # K and V, bf16
    assert ring.bytes_per_call == kv_block
    # K/V forward and backward (cp-1 hops each), dK/dV cp hops (the last back to its owner)
    assert ring.calls == (2 * (cp - 1) + cp) * L8B.num_layers
    assert est.comm_bytes_per_step["dp"] > 0  # gradients are averaged over the cp ranks


def test_cp_allgather_and_alltoall_bytes():
    cp, s = 4, 8192
    tokens = 2 * (s // cp) * L8B.d_head  # bf16 bytes per head of the local shard
    kv_block = 2 * tokens * L8B.kv_heads
    layers = L8B.num_layers
    ag = estimate(L8B, cp=cp, seq_len=s, cp_mode="allgather")
    # K/V gathered in forward and again in backward, dK/dV reduce-scattered: 3 x (cp-1)/cp x cp blocks
    assert ag.comm_bytes_per_step["cp"] == pytest.approx(3 * layers * (cp - 1) * kv_block)
    a2a = estimate(L8B, cp=cp, seq_len=s, cp_mode="alltoall")
    # q, k, v, out forward and their gradients backward, each sending (cp-1)/cp of the local tensor
    per_layer = 2 * (2 * tokens * L8B.num_heads + kv_block) * (cp - 1) / cp
    assert a2a.comm_bytes_per_step["cp"] == pytest.approx(layers * per_layer)
    assert {c.collective for c in a2a.comm if c.dim == "cp"} == {Collective.ALL_TO_ALL}
    # Ulysses' bytes per rank fall with cp, the ring's do not
    ring = {c: estimate(L8B, cp=c, seq_len=s).comm_bytes_per_step["cp"] for c in (2, 8)}
    uly = {c: estimate(L8B, cp=c, seq_len=s, cp_mode="alltoall").comm_bytes_per_step["cp"] for c in (2, 8)}
    assert uly[8] < uly[2] and ring[8] > ring[2]


def test_cp_alltoall_needs_heads_divisible_by_cp():
    with pytest.raises(LayoutError, match="cp must divide both"):
        estimate(L8B, cp=16, seq_len=8192, cp_mode="alltoall")  # 8 KV heads


def test_pp_sends_activations_each_way_per_microbatch_and_chunk():
    fields = dict(pp=4, microbatches=8, schedule="interleaved_1f1b", virtual_stages=2, seq_len=4096)
    (p2p,) = [c for c in estimate(L8B, **fields).comm if c.dim == "pp"]
    assert p2p.calls == 2 * 2 * 8 and p2p.bytes_per_call == 2 * 4096 * L8B.hidden_size
    assert p2p.link == Link.INTRA  # 4 ranks: one node
    (p2p,) = [c for c in estimate(L8B, dp_shard=8, **fields).comm if c.dim == "pp"]
    assert p2p.link == Link.INTER  # pp is the outermost dimension: stages sit 8 ranks apart


def test_ep_all_to_all():
    est = estimate(MIXTRAL, dp_shard=8, ep=8, seq_len=4096)
    (a2a,) = [c for c in est.comm if c.dim == "ep"]
    assert a2a.collective == Collective.ALL_TO_ALL
    assert a2a.calls == 4 * MIXTRAL.num_layers
    assert a2a.bytes_per_call == 2 * 4096 * MIXTRAL.experts_top_k * MIXTRAL.hidden_size
    # Expert grads are averaged only over ranks holding the same experts (8 / ep = 1 here).
    assert all("expert" not in c.what for c in est.comm if c.dim == "dp")


def test_single_rank_communicates_nothing():
    est = estimate(L8B, seq_len=1024)
    assert est.comm == () and est.comm_bytes_per_step["total"] == 0

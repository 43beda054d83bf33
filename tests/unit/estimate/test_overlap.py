"""How much data-parallel traffic compute hides (overlap.py), per the runtime's protocol."""

import pytest

from lightning_5d.config import ZeroStage
from lightning_5d.estimate import Cluster, estimate, get_preset, predict_step_time
from lightning_5d.estimate.comm import Collective
from lightning_5d.estimate.overlap import stream_exposed

L8B = get_preset("llama3-8b")


def test_stream_always_exposes_its_last_piece():
    assert stream_exposed(1.0, 10, 100.0) == pytest.approx(0.1)  # window long enough: only the tail shows
    assert stream_exposed(1.0, 1, 100.0) == pytest.approx(1.0)  # one piece: nothing to overlap with
    assert stream_exposed(0.0, 10, 1.0) == 0.0


def test_stream_longer_than_its_window_exposes_the_excess():
    # 10 pieces of 0.2 s, ready every 0.1 s over a 1 s window: the link runs 2 s from t = 0.1.
    assert stream_exposed(2.0, 10, 1.0) == pytest.approx(2.0 - 1.0 + 0.1)


def _dp_seconds(est, cluster, collective):
    return sum(
        e.bytes_per_rank / cluster.bandwidth(e.link) + e.launches * cluster.latency(e.link)
        for e in est.comm
        if e.dim == "dp" and e.collective == collective
    )


def test_zero1_post_step_all_gather_is_fully_exposed():
    cluster = Cluster(gpus=8)
    est = estimate(L8B, dp_shard=8, zero=1, seq_len=4096, grad_accum=8)
    t = predict_step_time(est, cluster)
    gather = _dp_seconds(est, cluster, Collective.ALL_GATHER)
    assert gather > 0 and t.exposed["dp"] >= gather


def test_zero2_reduces_behind_each_backward_not_the_whole_step():
    cluster = Cluster(gpus=64)
    est = estimate(L8B, dp_shard=64, zero=ZeroStage.GRADIENTS, seq_len=4096, grad_accum=16)
    t = predict_step_time(est, cluster)
    # The reduce-scatters alone fit in the step's compute, but not in the backward of each microbatch.
    assert t.comm["dp"] < t.compute and t.exposed["dp"] > _dp_seconds(est, cluster, Collective.ALL_GATHER)


def test_hsdp_replica_all_reduce_of_zero1_is_exposed():
    cluster = Cluster(gpus=64)
    hsdp = estimate(L8B, dp_replicate=8, dp_shard=8, zero=1, seq_len=4096, grad_accum=16)
    replicas = _dp_seconds(hsdp, cluster, Collective.ALL_REDUCE)
    assert replicas > 0 and predict_step_time(hsdp, cluster).exposed["dp"] >= replicas

"""Per-rank memory: how each dimension and mode moves params, grads, optimizer, activations."""

import dataclasses

import pytest

from lightning_5d.config import ActivationCheckpointing, ZeroStage
from lightning_5d.estimate import (
    GIB,
    Precision,
    Stage,
    TrainingSetup,
    count_params,
    estimate,
    get_preset,
    in_flight_layer_microbatches,
    layer_activations,
    rank_params,
)
from lightning_5d.estimate.memory import stage_activations

L8B = get_preset("llama3-8b")
L70B = get_preset("llama3-70b")


def test_single_rank_holds_16_bytes_per_param_in_the_papers_accounting():
    est = estimate(L8B, seq_len=1024, zero=0, state_accounting="paper")
    m = est.memory
    assert m.params + m.grads + m.optimizer == 16 * count_params(L8B).total


def test_runtime_accounting_adds_the_fp32_gradient_the_master_steps_with():
    psi = count_params(L8B).total
    m = estimate(L8B, seq_len=1024, zero=0).memory  # the default: what FiveDStrategy holds
    assert (m.params, m.grads, m.optimizer) == (2 * psi, 4 * psi, 12 * psi)
    fp32 = estimate(L8B, seq_len=1024, zero=0, precision="fp32").memory
    assert (fp32.params, fp32.grads, fp32.optimizer) == (4 * psi, 4 * psi, 8 * psi)  # no separate master


def test_runtime_fp32_accumulation_reduces_every_microbatch_into_the_masters():
    psi = count_params(L8B).total
    m = estimate(L8B, dp_shard=8, zero=1, seq_len=1024, fp32_grad_accumulation=True).memory
    assert m.grads == pytest.approx(4 * psi / 8)  # no full bf16 gradient kept between micro-batches
    z0 = estimate(L8B, seq_len=1024, zero=0, fp32_grad_accumulation=True).memory
    assert z0.grads == 4 * psi  # no accumulator beside the masters' fp32 gradients


@pytest.mark.parametrize("zero, per_param", [(0, (2, 4, 12)), (1, (2, 2 + 4 / 8, 12 / 8)), (2, (2, 4 / 8, 12 / 8)),
                                             (3, (4 / 8, 4 / 8, 8 / 8))])  # fmt: skip
def test_runtime_accounting_per_zero_stage(zero, per_param):
    psi = count_params(L8B).total
    m = estimate(L8B, dp_shard=4, cp=2, zero=zero, seq_len=1024).memory
    assert (m.params, m.grads, m.optimizer) == pytest.approx(tuple(b * psi for b in per_param))


@pytest.mark.parametrize(
    "precision, fp32_accum, per_param", [("fp32", False, 16), ("bf16", True, 20), ("fp8", False, 16)]
)
def test_precisions(precision, fp32_accum, per_param):
    m = estimate(
        L8B, seq_len=1024, precision=precision, fp32_grad_accumulation=fp32_accum, state_accounting="paper"
    ).memory
    assert m.params + m.grads + m.optimizer == per_param * count_params(L8B).total


def test_fp32_activations_are_twice_bf16():
    bf16 = layer_activations(L8B, TrainingSetup(seq_len=1024))
    fp32 = layer_activations(L8B, TrainingSetup(seq_len=1024, precision=Precision.FP32))
    assert fp32.sharded == pytest.approx(2 * bf16.sharded, rel=1e-3)


def test_zero_stages_shard_over_dp_shard_times_cp():
    psi = count_params(L8B).total
    for zero in ZeroStage:
        m = estimate(L8B, dp_shard=4, cp=2, zero=zero, seq_len=1024, state_accounting="paper").memory
        nd = 8
        assert m.optimizer == pytest.approx(12 * psi / (nd if zero >= 1 else 1))
        assert m.grads == pytest.approx(2 * psi / (nd if zero >= 2 else 1))
        assert m.params == pytest.approx(2 * psi / (nd if zero >= 3 else 1))


def test_dp_replicate_does_not_shard():
    a = estimate(L8B, dp_replicate=4, dp_shard=2, zero=3, seq_len=1024).memory
    b = estimate(L8B, dp_shard=2, zero=3, seq_len=1024).memory
    assert a.params == b.params and a.optimizer == b.optimizer


def test_tp_splits_weights_and_pp_splits_layers():
    full = rank_params(L70B, TrainingSetup(), Stage.FIRST)
    tp8 = rank_params(L70B, TrainingSetup(tp=8), Stage.FIRST)
    assert tp8.total == pytest.approx(full.total / 8, rel=1e-3)
    pp4 = {s: rank_params(L70B, TrainingSetup(pp=4), s) for s in Stage}
    assert pp4[Stage.FIRST].layers == 20
    counts = count_params(L70B)
    # Across all stages every parameter is held once (untied embeddings).
    middle = 2 * pp4[Stage.FIRST].layers * counts.layer.total
    assert pp4[Stage.FIRST].total + pp4[Stage.LAST].total + middle == counts.total


def test_tied_embeddings_are_copied_to_the_last_stage():
    spec = L8B.replace(tie_embeddings=True)
    last = rank_params(spec, TrainingSetup(pp=2), Stage.LAST)
    assert last.dense - 16 * count_params(spec).layer.total == spec.vocab_size * spec.hidden_size + spec.hidden_size


def test_experts_shard_over_ep():
    spec = get_preset("mixtral-8x7b")
    counts = count_params(spec)
    ep8 = rank_params(spec, TrainingSetup(ep=8, dp_shard=8), Stage.FIRST)
    assert ep8.expert == counts.layer.experts * spec.num_layers // 8
    m1 = estimate(spec, dp_shard=8, zero=1, seq_len=1024).memory
    m8 = estimate(spec, dp_shard=8, ep=8, zero=1, seq_len=1024).memory
    assert m8.params < m1.params / 4


def test_activation_modes_order_and_full_recompute_keeps_the_layer_input():
    sizes = {
        r: stage_activations(L8B, TrainingSetup(seq_len=4096, recompute=r, attention="eager"), Stage.FIRST)
        for r in ActivationCheckpointing
    }
    assert sizes["none"].layers > sizes["selective"].layers > sizes["full"].layers
    assert sizes["full"].layers == 2 * 4096 * 4096 * 32  # 2sbh per layer
    assert sizes["none"].recompute_peak == 0 < sizes["full"].recompute_peak


def test_flash_attention_stores_no_scores():
    flash = layer_activations(L8B, TrainingSetup(seq_len=8192))
    eager = layer_activations(L8B, TrainingSetup(seq_len=8192, attention="eager"))
    assert flash.scores == 0 and eager.scores == 2 * 32 * 8192**2
    assert flash.sharded < eager.sharded + 1e9


def test_sp_and_cp_split_activations():
    base = layer_activations(L70B, TrainingSetup(seq_len=4096, tp=8, sequence_parallel=False))
    sp = layer_activations(L70B, TrainingSetup(seq_len=4096, tp=8))
    assert sp.replicated == pytest.approx(base.replicated / 8)
    assert sp.sharded == base.sharded
    cp = layer_activations(L70B, TrainingSetup(seq_len=4096, tp=8, cp=2))
    assert cp.replicated + cp.sharded == pytest.approx((sp.replicated + sp.sharded) / 2)


@pytest.mark.parametrize(
    "schedule, m, v, expected",
    [
        ("afab", 16, 1, 16 * 8),  # all m microbatches of L/p = 8 layers
        ("1f1b", 16, 1, 32),  # p microbatches of L/p layers = L
        ("1f1b", 2, 1, 2 * 8),  # fewer microbatches than stages: all of them
        ("interleaved_1f1b", 16, 2, 32 * (1 + 3 / 8)),  # L(1 + (p-1)/(pv))
        ("zero_bubble", 16, 1, 32),
        ("zbv", 16, 2, 32),
        ("dualpipev", 16, 2, 5 * 8),  # p+1 microbatches
    ],
)
def test_in_flight_microbatches_on_the_first_stage(schedule, m, v, expected):
    setup = TrainingSetup(pp=4, schedule=schedule, microbatches=m, virtual_stages=v)
    assert in_flight_layer_microbatches(setup, 32) == pytest.approx(expected)


def test_most_loaded_rank_is_reported():
    est = estimate(L70B, tp=8, pp=4, dp_shard=4, zero=1, seq_len=4096)
    assert est.memory.stage == Stage.FIRST  # 1F1B: stage 0 keeps p microbatches
    tiny_batch = estimate(L8B, pp=8, microbatches=1, seq_len=4096)
    assert tiny_batch.memory.stage == Stage.LAST  # one microbatch everywhere: the logits tip it
    assert 0 < est.memory.total / GIB < 80


def test_zero3_gathers_a_layer_buffer():
    z3 = estimate(L8B, dp_shard=8, zero=3, seq_len=1024).memory
    z2 = estimate(L8B, dp_shard=8, zero=2, seq_len=1024).memory
    layer = count_params(L8B).layer.total
    assert z3.detail["buffer_zero3_gather"] == 2 * 2 * layer + 2 * layer
    assert z2.buffers < z3.buffers


def test_zero3_counts_the_gathered_head_unit():
    """Untied: final norm + head held through the step (bf16); tied: the shared embedding, in the root."""
    c = count_params(L8B)
    z3 = estimate(L8B, dp_shard=8, zero=3, seq_len=1024).memory
    assert z3.detail["buffer_zero3_head_unit"] == 2 * (c.final_norm + c.head)
    tp2 = estimate(L8B, dp_shard=4, tp=2, zero=3, seq_len=1024).memory
    assert tp2.detail["buffer_zero3_head_unit"] == 2 * (c.final_norm + c.head // 2)
    tied = dataclasses.replace(L8B, tie_embeddings=True)
    ct = count_params(tied)
    assert ct.head == 0
    t3 = estimate(tied, dp_shard=8, zero=3, seq_len=1024).memory
    assert t3.detail["buffer_zero3_head_unit"] == 2 * (ct.embedding + ct.final_norm)
    # Under pp every layer of the rank is already counted as held; no separate head term.
    pp = estimate(L8B, dp_shard=4, pp=2, zero=3, seq_len=1024).memory
    assert "buffer_zero3_head_unit" not in pp.detail


def test_cp_mode_buffers():
    """Ring: two K/V blocks; all-gather: all cp of them; all-to-all: head-shard copies of q, k, v, out."""
    cp, s = 4, 8192
    kv_block = 2 * 2 * (s // cp) * L8B.d_head * L8B.kv_heads
    q = 2 * (s // cp) * L8B.d_head * L8B.num_heads
    modes = ("ring", "allgather", "alltoall")
    detail = {mode: estimate(L8B, cp=cp, seq_len=s, cp_mode=mode).memory.detail for mode in modes}
    assert detail["ring"]["buffer_cp_ring"] == 2 * kv_block
    assert detail["allgather"]["buffer_cp_gathered_kv"] == cp * kv_block
    assert detail["alltoall"]["buffer_cp_head_shards"] == 2 * (2 * q + kv_block)

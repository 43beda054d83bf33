"""The published numbers of /work/shared/reference/planner-cases.md, cases 1-7, at their stated precision."""

import pytest

from lightning_5d.config import ActivationCheckpointing, PipelineSchedule, ZeroStage
from lightning_5d.estimate import (
    GIB,
    AttentionKernel,
    MlpKind,
    ModelSpec,
    NormKind,
    TrainingSetup,
    activation_memory,
    bubble_fraction,
    bubble_relative,
    count_params,
    estimate,
    get_preset,
    model_state_bytes,
    training_flops,
    utilization,
)
from lightning_5d.estimate.published import (
    kor_hardware_flops_full,
    kor_hardware_flops_selective,
    kor_layer_activation_bytes,
    kor_model_flops,
    nar_param_count,
)


def gpt(L, h, a, V=51200, s=2048, **kw):
    """The papers' model family: GeLU MLP of 4h, multi-head attention, dropout, LayerNorm, learned positions."""
    fields = dict(
        vocab_size=V,
        hidden_size=h,
        intermediate_size=4 * h,
        num_layers=L,
        num_heads=a,
        max_seq_len=s,
        mlp=MlpKind.GELU,
        norm=NormKind.LAYERNORM,
        dropout=True,
        learned_positions=True,
        tie_embeddings=True,
    )
    fields.update(kw)
    return ModelSpec(name=f"gpt-{L}x{h}", **fields)


# --- case 1: Llama-3.1 parameter counts (exact) -------------------------------------------


@pytest.mark.parametrize("preset, expected", [("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496)])
def test_case1_llama_param_count(preset, expected):
    assert count_params(get_preset(preset)).total == expected


def test_case1_shapes_are_the_stated_ones():
    spec = get_preset("llama3-8b")
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.kv_heads, spec.intermediate_size) == (
        32,
        4096,
        32,
        8,
        14336,
    )
    assert (spec.vocab_size, spec.tie_embeddings) == (128256, False)


# --- case 2: 16N / 20N bytes of model state (exact) ---------------------------------------


def test_case2_mixed_precision_model_state():
    assert model_state_bytes(70e9).total == pytest.approx(1120e9, rel=1e-12)
    assert model_state_bytes(70e9, fp32_grad_accumulation=True).total == pytest.approx(1400e9, rel=1e-12)


# --- case 3: ZeRO paper Fig. 1 (decimal GB, one decimal) -----------------------------------


@pytest.mark.parametrize("zero, gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_case3_zero_paper_figure1(zero, gb):
    assert model_state_bytes(7.5e9, ZeroStage(zero), nd=64).total / 1e9 == pytest.approx(gb, abs=0.05)


def test_case3_zero_stage_formulas_term_by_term():
    psi, nd, k = 7.5e9, 64, 12
    z = {s: model_state_bytes(psi, s, nd) for s in ZeroStage}
    assert (z[1].params, z[1].grads, z[1].optimizer) == (2 * psi, 2 * psi, k * psi / nd)
    assert (z[2].params, z[2].grads, z[2].optimizer) == (2 * psi, 2 * psi / nd, k * psi / nd)
    assert z[3].total == pytest.approx((2 + 2 + k) * psi / nd)


# --- case 4: activations of the 8B shape, s=1024, b=1, no TP (GiB, exact) ------------------

CASE4 = [
    (ActivationCheckpointing.NONE, 9.25),
    (ActivationCheckpointing.SELECTIVE, 4.25),
    (ActivationCheckpointing.FULL, 0.25),
]


@pytest.mark.parametrize("recompute, gib", CASE4)
def test_case4_closed_form(recompute, gib):
    per_layer = kor_layer_activation_bytes(s=1024, b=1, h=4096, a=32, recompute=recompute)
    assert 32 * per_layer / GIB == gib


@pytest.mark.parametrize("recompute, gib", CASE4)
def test_case4_general_code_on_the_paper_model(recompute, gib):
    """The shape-aware term table reproduces KOR for the model KOR describes (eager attention, dropout)."""
    setup = TrainingSetup(
        seq_len=1024, micro_batch_size=1, recompute=recompute, attention=AttentionKernel.EAGER
    )
    assert activation_memory(gpt(L=32, h=4096, a=32), setup) / GIB == gib


@pytest.mark.parametrize("t", [2, 4, 8])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("recompute", [ActivationCheckpointing.NONE, ActivationCheckpointing.SELECTIVE])
def test_case4_table2_tp_and_sp_rows(t, sp, recompute):
    s, b, h, a = 2048, 2, 4096, 32
    setup = TrainingSetup(
        tp=t,
        sequence_parallel=sp,
        seq_len=s,
        micro_batch_size=b,
        recompute=recompute,
        attention=AttentionKernel.EAGER,
    )
    expected = kor_layer_activation_bytes(s, b, h, a, t=t, sequence_parallel=sp, recompute=recompute)
    assert activation_memory(gpt(L=1, h=h, a=a), setup) == pytest.approx(expected, rel=1e-12)


# --- case 5: pipeline bubble relative to ideal (exact) -------------------------------------


@pytest.mark.parametrize(
    "p, m, v, schedule, expected",
    [
        (8, 32, 8, PipelineSchedule.INTERLEAVED_1F1B, 0.02734375),
        (8, 32, 1, PipelineSchedule.ONE_F_ONE_B, 0.21875),
        (8, 32, 1, PipelineSchedule.AFAB, 0.21875),
        (8, 1, 1, PipelineSchedule.ONE_F_ONE_B, 7.0),
    ],
)
def test_case5_bubble_relative_to_ideal(p, m, v, schedule, expected):
    assert bubble_relative(p, m, v, schedule) == expected


@pytest.mark.parametrize("p, m, v", [(8, 32, 1), (8, 32, 8), (4, 8, 2), (8, 1, 1)])
def test_case5_bubble_fraction_of_total(p, m, v):
    schedule = PipelineSchedule.INTERLEAVED_1F1B if v > 1 else PipelineSchedule.ONE_F_ONE_B
    assert bubble_fraction(p, m, v, schedule) == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-12)


# --- case 6: KOR MFU / HFU (two decimals of a percent) -------------------------------------

CASE6 = [
    # name, B, L, h, gpus, seconds, MFU %, HFU %
    ("22B", 4, 48, 6144, 8, 1.10, 41.65, 43.81),
    ("175B", 64, 96, 12288, 64, 13.75, 51.39, 52.77),
]
V, S, A100 = 51200, 2048, 312e12


@pytest.mark.parametrize("name, B, L, h, gpus, seconds, mfu, hfu", CASE6)
def test_case6_kor_mfu_hfu(name, B, L, h, gpus, seconds, mfu, hfu):
    assert 100 * utilization(kor_model_flops(B, L, S, h, V), seconds, gpus, A100) == pytest.approx(
        mfu, abs=0.005
    )
    hardware = kor_hardware_flops_selective(B, L, S, h, V)
    assert 100 * utilization(hardware, seconds, gpus, A100) == pytest.approx(hfu, abs=0.005)


@pytest.mark.parametrize("name, B, L, h, gpus, seconds, mfu, hfu", CASE6)
def test_case6_general_flops_match_kor(name, B, L, h, gpus, seconds, mfu, hfu):
    """6*N_matmul + 12*L*s*h per token is KOR's model FLOPs exactly; full recompute is KOR's 96-form."""
    spec = gpt(L=L, h=h, a=h // 128, learned_positions=False)
    tp = min(gpus, 8)
    setup = TrainingSetup(tp=tp, dp_shard=gpus // tp, seq_len=S, grad_accum=B // (gpus // tp), zero=0)
    assert setup.global_batch == B
    est = estimate(spec, setup)
    assert est.flops.model_per_step == pytest.approx(kor_model_flops(B, L, S, h, V), rel=1e-12)
    assert 100 * est.mfu(seconds, A100) == pytest.approx(mfu, abs=0.005)
    full = training_flops(spec, setup.replace(recompute=ActivationCheckpointing.FULL))
    assert full.hardware_per_step == pytest.approx(kor_hardware_flops_full(B, L, S, h, V), rel=1e-12)
    assert est.hfu(seconds, A100) == est.mfu(seconds, A100)  # no recompute: HFU = MFU


def test_case6_selective_recompute_counts_one_attention_forward():
    """Our hardware FLOPs re-run the attention core's forward (4*L*s*h per token), which is below KOR's s/(3h) form."""
    spec = gpt(L=48, h=6144, a=48, learned_positions=False)
    setup = TrainingSetup(seq_len=S, recompute=ActivationCheckpointing.SELECTIVE)
    f = training_flops(spec, setup)
    assert f.hardware_per_token - f.model_per_token == pytest.approx(4 * 48 * S * 6144)
    assert f.hardware_per_step < kor_hardware_flops_selective(1, 48, S, 6144, V)


# --- case 7: NAR parameter count (4 significant digits) ------------------------------------


def test_case7_nar_param_count():
    assert nar_param_count(l=128, h=25600, V=51200, s=2048) == pytest.approx(1.008e12, rel=5e-4)


def test_case7_general_counter_matches_nar():
    """NAR's count is ours for a biased GPT with learned positions, minus the final LayerNorm it leaves out."""
    spec = gpt(L=128, h=25600, a=160, bias=True)
    counts = count_params(spec)
    assert counts.total - counts.final_norm == pytest.approx(
        nar_param_count(128, 25600, 51200, 2048), rel=1e-12
    )

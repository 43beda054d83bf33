"""Every layout-only refusal is one rule (lightning_5d.layout_rules) that the runtime raises
and the planner skips: the two cannot disagree about which layouts exist."""

import copy
from collections import Counter
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf, open_dict
from torch import nn

from lightning_5d.config import Layout, LayoutError, ParallelConfig, PipelineSchedule, ZeroStage
from lightning_5d.dimensions import check_precision_supported, combination_for
from lightning_5d.estimate.cli import default_global_batch
from lightning_5d.estimate.search import combination, enumerate_setups, plan, refused_text
from lightning_5d.estimate.spec import load_spec
from lightning_5d.estimate.timing import Cluster
from lightning_5d.estimate.training import TrainingSetup
from lightning_5d.layout_rules import RULES, Combination, Rule, refusal, validate_early
from lightning_5d.parallel.data.fsdp import fsdp_mesh
from lightning_5d.parallel.pipeline.batch import PipelineError
from lightning_5d.parallel.pipeline.loop import check_pipeline_supported
from lightning_5d.plan.blocks import ModelMappingError
from lightning_5d.precision import PrecisionError
from lightning_5d.strategy import FiveDStrategy
from lightning_5d.train import compose, validate

# One combination per rule that breaks that rule only, and the words its message must hold.
CASES = {
    Rule.HSDP_ZERO3_CP: (
        Combination(Layout(dp_replicate=2, dp_shard=1, cp=2), zero=ZeroStage.PARAMETERS),
        "HSDP (dp_replicate > 1) with ZeRO-3 and cp > 1 is not available yet",
    ),
    Rule.EP_SEQUENCE_PARALLEL: (
        Combination(Layout(dp_shard=2, tp=2, ep=2), sequence_parallel=True),
        "ep > 1 with sequence_parallel=true is not supported yet",
    ),
    Rule.ZERO3_SPLIT_BACKWARD: (
        Combination(Layout(dp_shard=2, pp=2), zero=ZeroStage.PARAMETERS, schedule=PipelineSchedule.ZBV,
                    virtual_stages=2),  # fmt: skip
        "zero=3 with pipeline.schedule=zbv",
    ),
    Rule.PIPELINE_SCHEDULE: (
        Combination(Layout(dp_shard=2, pp=4), microbatches=2),
        "needs at least one microbatch per stage (pp=4)",
    ),
    Rule.LOSS_SCALING_PP: (
        Combination(Layout(dp_shard=2, pp=2), loss_scaling=True),
        "precision='16-mixed' scales the loss with a GradScaler",
    ),
    Rule.FP32_ACCUMULATION_PP: (
        Combination(Layout(dp_shard=2, pp=2), fp32_accumulation=True),
        "accumulation_dtype='fp32' with pp > 1",
    ),
    Rule.FP8_ALL_GATHER_ZERO: (
        Combination(Layout(dp_shard=2), zero=ZeroStage.GRADIENTS, fp8_all_gather=True),
        "fp8_all_gather=true all-gathers ZeRO-3 parameters; zero=2",
    ),
}

# The same layouts as `l5d train` config values, set on one composed tiny recipe.
TRAIN_VALUES = {
    Rule.HSDP_ZERO3_CP: {"parallel.dp_replicate": 2, "parallel.dp_shard": 1, "parallel.cp": 2, "parallel.zero": 3},
    Rule.EP_SEQUENCE_PARALLEL: {"parallel.tp": 2, "parallel.ep": 2, "parallel.sequence_parallel": True},
    Rule.ZERO3_SPLIT_BACKWARD: {"parallel.pp": 2, "parallel.zero": 3, "parallel.pipeline.schedule": "zbv",
                                "parallel.pipeline.virtual_stages": 2},  # fmt: skip
    Rule.PIPELINE_SCHEDULE: {"parallel.pp": 4, "parallel.pipeline.microbatches": 2},
    Rule.LOSS_SCALING_PP: {"parallel.pp": 2, "precision": "16-mixed"},
    Rule.FP32_ACCUMULATION_PP: {"parallel.pp": 2, "precision": "bf16-mixed",
                                "precision_options": {"accumulation_dtype": "fp32"}},  # fmt: skip
    Rule.FP8_ALL_GATHER_ZERO: {"parallel.zero": 2, "precision": "fp8-tensorwise",
                               "precision_options": {"fp8": {"fp8_all_gather": True}}},  # fmt: skip
}


@pytest.fixture(scope="module")
def tiny_cfg():
    cfg = compose(["recipe=tiny_dp"])
    # Layout-only rules: no model, so no shape check (ep on the dense tiny model) answers first.
    with open_dict(cfg):
        del cfg["model"]
    return cfg


# The planner's candidates (TrainingSetup) for the rules it can express; it never scales the
# loss (no fp16) nor gathers FP8 weights, so those two cannot arise from it.
PLANNER_SETUPS = {
    Rule.HSDP_ZERO3_CP: TrainingSetup(dp_replicate=2, cp=2, zero=3),
    Rule.EP_SEQUENCE_PARALLEL: TrainingSetup(dp_shard=2, tp=2, ep=2, sequence_parallel=True),
    Rule.ZERO3_SPLIT_BACKWARD: TrainingSetup(dp_shard=2, pp=2, zero=3, schedule="zbv", virtual_stages=2),
    Rule.PIPELINE_SCHEDULE: TrainingSetup(dp_shard=2, pp=4, microbatches=2),
    Rule.FP32_ACCUMULATION_PP: TrainingSetup(dp_shard=2, pp=2, fp32_grad_accumulation=True),
}


def test_every_rule_has_a_case():
    assert set(CASES) == set(RULES) == set(Rule) == set(TRAIN_VALUES)


@pytest.mark.parametrize("rule", list(Rule), ids=lambda r: r.value)
def test_the_rule_refuses_its_case_and_only_that(rule):
    case, words = CASES[rule]
    assert refusal(case)[0] == rule and words in refusal(case)[1]
    broken = [r for r, check in RULES.items() if check(case) is not None]
    assert broken == [rule]


@pytest.mark.parametrize("rule", list(Rule), ids=lambda r: r.value)
def test_l5d_train_refuses_it_before_any_worker(rule, tiny_cfg):
    case, words = CASES[rule]
    cfg = copy.deepcopy(tiny_cfg)
    with open_dict(cfg):
        cfg.devices, cfg.parallel.dp_shard = case.layout.world_size, "auto"
        for key, value in TRAIN_VALUES[rule].items():
            OmegaConf.update(cfg, key, value, force_add=True)
    with pytest.raises(LayoutError) as err:
        validate(cfg)
    assert words in str(err.value)


@pytest.mark.parametrize("rule", list(PLANNER_SETUPS), ids=lambda r: r.value)
def test_the_planner_refuses_the_same_candidate(rule):
    found = refusal(combination(PLANNER_SETUPS[rule]))
    assert found is not None and found[0] == rule


class _Mesh:
    def __init__(self, layout: Layout) -> None:
        self.layout = layout

    def size(self, dim: str) -> int:
        return getattr(self.layout, dim)


class _Module(nn.Module):
    automatic_optimization = True


def _strategy(case: Combination) -> FiveDStrategy:
    pipeline = {"schedule": case.schedule, "virtual_stages": case.virtual_stages}
    strategy = FiveDStrategy(pp=case.layout.pp, dp_shard="auto", zero=case.zero, pipeline=pipeline)
    strategy._layout = case.layout  # what setup_environment resolves once the world size is known
    return strategy


def _precision(case: Combination) -> SimpleNamespace:
    fp8 = SimpleNamespace(fp8_all_gather=case.fp8_all_gather) if case.fp8_all_gather else None
    return SimpleNamespace(fp32_accumulation=case.fp32_accumulation, fp8=fp8, guard=SimpleNamespace(every=0))


def _runtime_site(rule: Rule, case: Combination) -> None:
    """Call the code that raises ``rule`` during FiveDStrategy.setup, with ``case``'s values."""
    if rule == Rule.HSDP_ZERO3_CP:
        fsdp_mesh(_Mesh(case.layout))
    elif rule in (Rule.ZERO3_SPLIT_BACKWARD, Rule.LOSS_SCALING_PP):
        check_pipeline_supported(_Module(), case)
    elif rule == Rule.PIPELINE_SCHEDULE:
        config = ParallelConfig(pp=case.layout.pp, pipeline={"microbatches": case.microbatches})
        validate_early(config)
    else:
        strategy, precision = _strategy(case), _precision(case)
        combination = combination_for(strategy.config, strategy.layout, precision, loss_scaling=False)
        check_precision_supported(precision, combination, strategy.config)


ERRORS = {
    Rule.HSDP_ZERO3_CP: ModelMappingError,
    Rule.EP_SEQUENCE_PARALLEL: LayoutError,
    Rule.ZERO3_SPLIT_BACKWARD: PipelineError,
    Rule.PIPELINE_SCHEDULE: LayoutError,
    Rule.LOSS_SCALING_PP: PipelineError,
    Rule.FP32_ACCUMULATION_PP: PrecisionError,
    Rule.FP8_ALL_GATHER_ZERO: PrecisionError,
}


@pytest.mark.parametrize("rule", [r for r in Rule if r != Rule.EP_SEQUENCE_PARALLEL], ids=lambda r: r.value)
def test_the_runtime_site_raises_the_rule(rule):
    case, words = CASES[rule]
    with pytest.raises(ERRORS[rule]) as err:
        _runtime_site(rule, case)
    assert words in str(err.value)


def test_enumerated_candidates_pass_the_runtime_rules_and_the_rest_are_counted():
    refused: Counter = Counter()
    setups = list(
        enumerate_setups(load_spec("llama3-8b"), 64, seq_len=4096, global_batch=512, refused=refused)
    )
    assert setups and all(refusal(combination(s)) is None for s in setups)
    assert refused[Rule.HSDP_ZERO3_CP] > 0  # the combination found in the 64-GPU plan
    assert refused_text(refused).startswith(f"skipped {sum(refused.values())} candidate layouts")


# The documented `l5d plan` cases (README.md, docs/planner.md).
DOCUMENTED = [  # as `l5d plan` runs them: seq 4096, the CLI's default global batch unless given
    ("llama3-8b", Cluster(gpus=64, gpu_memory_gib=80, gpus_per_node=8), {"global_batch": default_global_batch(4096)}),
    # ~5 s of planning (the MoE search is wide): in the slow tier
    pytest.param("mixtral-8x7b", Cluster(gpus=32), {"global_batch": 512}, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("model, cluster, kwargs", DOCUMENTED, ids=["llama3-8b", "mixtral-8x7b"])
def test_documented_plans_rank_only_layouts_the_runtime_accepts(model, cluster, kwargs):
    refused: Counter = Counter()
    entries = plan(model, cluster, seq_len=4096, top=10, refused=refused, **kwargs)
    assert len(entries) == 10
    for entry in entries:
        assert refusal(combination(entry.setup)) is None, entry.setup.describe()
        s = entry.setup
        assert not (s.zero == ZeroStage.PARAMETERS and s.dp_replicate > 1 and s.cp > 1)

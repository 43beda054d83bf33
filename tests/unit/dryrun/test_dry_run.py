"""The start-up dry run: every production recipe, and the claims the dry run rests on.

Each production recipe (composed as ``l5d train`` composes it) is cut on the meta device for
every class of ranks; its counted states must match the planner's prediction for the same
pieces within ``STATE_TOLERANCE`` per term (what is left is ZeRO's ceil slices), every rank
must be counted once, and the verdict must say whether it fits the recipe's GPU.
"""

import dataclasses

import pytest

from lightning_5d.config import ParallelConfig, ZeroStage
from lightning_5d.dimensions import combination_for
from lightning_5d.dryrun.holdings import CutClasses
from lightning_5d.dryrun.recipe import GIB, dry_run, main
from lightning_5d.dryrun.startup import startup_classes
from lightning_5d.dryrun.state import StateRules
from lightning_5d.models import LlamaConfig, LlamaLM
from lightning_5d.train import compose

STATE_TOLERANCE = 0.005  # per term (params, grads, optimizer), counted vs the planner
PRODUCTION = [
    "llama3_8b_8gpu",
    "mixtral_8x7b_32gpu",
    # tp=8 cuts of 80 / 126 blocks per pipeline stage on meta: ~6-15 s and ~20-60 s on 2 busy cores,
    # too slow for the fast tier (its tp x pp cutting is covered there by the tiny model below).
    pytest.param("llama3_70b_64gpu", marks=pytest.mark.extended),
    pytest.param("llama3_405b_1024gpu", marks=pytest.mark.extended),
]


@pytest.mark.parametrize("recipe", PRODUCTION)
def test_production_recipe_dry_run_matches_the_planner_and_fits(recipe):
    report = dry_run(compose([f"recipe={recipe}"], return_hydra_config=True))
    print(report.format())
    ranks = sorted(r for c in report.classes for r in c.rank_class.ranks)
    assert ranks == list(range(len(ranks))) and len(ranks) == int(report.layout_text.rsplit("= ", 1)[1].split()[0])
    for c in report.classes:
        for term, diff in c.state_diff().items():
            assert abs(diff) <= STATE_TOLERANCE, (recipe, c.rank_class.ranks[:4], term, diff)
        assert c.rank_class.state.transient > 0  # every rank recomputes at least one tensor
    # The planner models every stage with the most loaded stage's blocks: an upper bound.
    assert report.planner_total >= report.busiest.first_step * (1 - STATE_TOLERANCE)
    assert report.fits, report.format()
    assert "fits" in report.verdict() and f"{report.usable / GIB:.1f} GiB usable" in report.verdict()


def test_a_recipe_that_does_not_fit_says_which_term_and_what_to_change(capsys):
    # ZeRO-0 keeps whole AdamW states (12 bytes/param) on every rank: 8B needs ~90 GiB for them alone.
    code = main(["recipe=llama3_8b_8gpu", "parallel.zero=0", "data.seq_len=1024"])
    out = capsys.readouterr().out
    assert code == 1
    assert "does NOT fit" in out and "optimizer dominates" in out and "raise parallel.zero" in out


def test_a_refused_layout_and_a_sweep_flag_exit_2_before_anything_is_built(capsys):
    assert main(["recipe=llama3_8b_8gpu", "parallel.tp=3"]) == 2
    assert "invalid config" in capsys.readouterr().err
    assert main(["recipe=llama3_8b_8gpu", "-m"]) == 2
    assert "one job at a time" in capsys.readouterr().err


TINY_MOE = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                       num_kv_heads=2, num_experts=4, experts_top_k=2, moe_intermediate_size=64)  # fmt: skip


@pytest.mark.parametrize("zero", [ZeroStage.OPTIMIZER, ZeroStage.PARAMETERS])
def test_tp_and_ep_ranks_of_a_stage_hold_the_same_bytes_as_cut_one_by_one(zero):
    """CutClasses.STAGE cuts one rank per pipeline stage; cutting every (pp, tp, ep) coordinate agrees."""
    config = ParallelConfig.from_mapping({"tp": 2, "pp": 2, "ep": 2, "dp_shard": "auto", "zero": int(zero),
                                          "pipeline": {"microbatches": 2}})  # fmt: skip
    layout = config.resolve(16)
    combination = combination_for(config, layout, None, False)
    rules = StateRules(zero=zero, low_precision_params=True)

    def per_rank(classes):
        found = startup_classes(lambda: LlamaLM(TINY_MOE), config, layout, combination, rules, classes)
        return {r: c.state for c in found for r in c.ranks}

    by_stage, by_coordinate = per_rank(CutClasses.STAGE), per_rank(CutClasses.COORDINATE)
    assert sorted(by_stage) == list(range(16))
    assert by_stage == by_coordinate
    assert len({s.params for s in by_stage.values()}) > 1  # the stages differ (embedding vs head)


def test_the_plan_check_counts_params_plus_the_largest_unsplit_tensor_in_fp32_where_it_runs():
    # tp rewrites the forward: setup checks the plan, holding the unsplit head (or embedding) in fp32.
    checked = dry_run(compose(["recipe=llama3_8b_8gpu", "parallel.tp=2"], return_hydra_config=True))
    state = checked.classes[0].rank_class.state
    assert state.check == 128256 * 4096 * 4 and state.check_name.endswith(("lm_head.weight", "embed_tokens.weight"))
    assert state.check_peak == state.params + state.check
    assert f"| {state.check_peak / GIB:.2f} |" in checked.format()
    # FP8 linears rewrite the forward too (the strategy's steps decide, with the worker's precision plugin).
    fp8 = dry_run(compose(["recipe=llama3_8b_8gpu", "precision=fp8_tensorwise"], return_hydra_config=True))
    assert fp8.classes[0].rank_class.state.check == 128256 * 4096 * 4
    # ZeRO-3 alone (the recipe) and verify=off under tp: nothing is checked, nothing counted.
    for overrides in ([], ["parallel.tp=2", "parallel.verify=off"]):
        plain = dry_run(compose(["recipe=llama3_8b_8gpu", *overrides], return_hydra_config=True))
        assert plain.classes[0].rank_class.state.check == 0 and "| - |" in plain.format()


def test_a_check_that_holds_more_than_the_first_step_sets_the_peak_and_the_verdict():
    report = dry_run(compose(["recipe=llama3_8b_8gpu", "parallel.tp=2"], return_hydra_config=True))
    c = report.classes[0]
    huge = dataclasses.replace(c.rank_class.state, check=int(200 * GIB))  # an fp32 tensor no GPU holds
    report = dataclasses.replace(report, classes=(dataclasses.replace(
        c, rank_class=dataclasses.replace(c.rank_class, state=huge)),))  # fmt: skip
    assert report.busiest.peak == huge.check_peak and not report.fits
    assert "the plan verifier's check dominates" in report.verdict() and "parallel.verify=off" in report.verdict()

"""Models built on the meta device: each rank materializes only its pieces, with one process's values.

The reference is the unchanged model built eagerly in one process (tests/distributed/scripts/
reference.py); the runs build it under ``trainer.init_module(empty_init=True)`` or in
``configure_model``, so every rank holds meta tensors until the dimensions have cut the model.
Equal initialization is what makes the losses agree to 1e-5 from the first step.
"""

import pytest

from reference import reference_run
from tests_support import TINY, LayoutRuns, assert_equivalent, selected_cases

from lightning_5d.config import ParallelConfig, ZeroStage
from lightning_5d.dimensions import combination_for
from lightning_5d.dryrun.startup import startup_classes
from lightning_5d.dryrun.state import StateRules
from lightning_5d.models import LlamaLM

STEPS = 3

# (nproc, zero, tp, pp, build, extra script args)
# --chunk-bytes: the tiny model's tensors recomputed in row chunks, each rank keeping its FSDP2
# rows (and under tp its column / row cut, fused segments included) of each chunk.
FAST = [
    (2, 3, 1, 1, "configure", ("--chunk-bytes", "4096")),
    (2, 1, 2, 1, "meta", ("--sp", "--chunk-bytes", "1000")),  # SP: its norms' tp-sum hooks must survive materialization
    (2, 1, 1, 2, "meta", ("--microbatches", "2")),
]
EXTENDED = [
    (2, 3, 1, 1, "meta", ()),
    (4, 3, 2, 1, "meta", ("--chunk-bytes", "2048")),  # tp x ZeRO-3
    (2, 1, 1, 1, "meta", ("--cp", "2")),
    (2, 2, 1, 1, "meta", ()),
    (4, 3, 2, 2, "configure", ("--microbatches", "2")),  # tp x pp x ZeRO-3, built in configure_model
    (2, 1, 1, 1, "meta", ("--ep", "2", "--model", "tiny_moe", "--chunk-bytes", "2048")),
    (4, 3, 1, 2, "meta", ("--microbatches", "2", "--chunk-bytes", "2048")),  # pp x ZeRO-3: materialized before pp's FSDP2 lazy init
    (8, 1, 2, 2, "meta", ("--sp", "--cp", "2", "--microbatches", "2")),  # tp+sp x cp x pp
    # all five: dp2 x tp2 x cp2 x pp2 with ep2 over dp x cp, ZeRO-3
    (16, 3, 2, 2, "meta", ("--cp", "2", "--ep", "2", "--model", "tiny_moe", "--microbatches", "2")),
]
PARAMS = "nproc,zero,tp,pp,build,extra"


def layout_case(test_name: str, params: dict):
    if not test_name.startswith(("test_meta_built_model_matches_single_process", "test_meta_built_bytes_")):
        return None
    key = tuple(params[name] for name in PARAMS.split(","))
    nproc, zero, tp, pp, build, extra = key
    options = dict(zero=zero, steps=STEPS, tp=tp, extra=("--pp", str(pp), "--build", build, *extra))
    return key, (nproc, options)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    return LayoutRuns(tmp_path_factory.mktemp("meta"), selected_cases(request, layout_case))


def check(runs, nproc, zero, tp, pp, build, extra):
    result, params = runs[(nproc, zero, tp, pp, build, extra)]
    assert (result["layout"]["tp"], result["layout"]["pp"], result["layout"]["zero"]) == (tp, pp, zero)
    model = extra[extra.index("--model") + 1] if "--model" in extra else "tiny"
    cp = int(extra[extra.index("--cp") + 1]) if "--cp" in extra else 1
    if "--chunk-bytes" in extra:  # the chunked way was taken (and its values are the ones compared below)
        assert all(rank["chunked"] > 0 for rank in result["model_state_bytes"])
    ref_losses, ref_params = reference_run(STEPS, nproc // (tp * pp * cp), model=model)
    assert_equivalent(result["losses"], params, ref_losses, ref_params)


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize(PARAMS, FAST)
def test_meta_built_model_matches_single_process(runs, nproc, zero, tp, pp, build, extra):
    check(runs, nproc, zero, tp, pp, build, extra)


@pytest.mark.distributed
@pytest.mark.extended
@pytest.mark.timeout(900)
@pytest.mark.parametrize(PARAMS, EXTENDED)
def test_meta_built_model_matches_single_process_more_layouts(runs, nproc, zero, tp, pp, build, extra):
    check(runs, nproc, zero, tp, pp, build, extra)


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize(PARAMS, FAST)
def test_meta_built_bytes_match_the_dry_run(runs, nproc, zero, tp, pp, build, extra):
    """What each rank measured (lightning_5d.accounting, before its 2nd optimizer step) is what
    `l5d train --dry-run` counts for the same layout, byte for byte (same runs as above)."""
    result, _ = runs[(nproc, zero, tp, pp, build, extra)]
    microbatches = int(extra[extra.index("--microbatches") + 1]) if "--microbatches" in extra else None
    config = ParallelConfig.from_mapping({"zero": zero, "tp": tp, "pp": pp, "dp_shard": "auto",
                                          "pipeline": {"microbatches": microbatches}})  # fmt: skip
    layout = config.resolve(nproc)
    rules = StateRules(zero=ZeroStage(zero), low_precision_params=False)  # fp32 runs
    combination = combination_for(config, layout, None, False)
    classes = startup_classes(lambda: LlamaLM(TINY), config, layout, combination, rules)
    counted = {r: c.state for c in classes for r in c.ranks}
    for rank, measured in enumerate(result["model_state_bytes"]):
        state = counted[rank]
        assert (measured["params"], measured["grads"], measured["optimizer"]) == (
            state.params, state.grads, state.optimizer), rank  # fmt: skip

"""Parameter groups from ``configure_optimizers`` (weight decay on the matrices only, the embedding
with its own learning rate, as nanoGPT and Hugging Face's Trainer group them) train as in one
process under every dimension.

The groups are built from the module the strategy hands to ``configure_optimizers``: ZeRO-1/2
then give the optimizer flat slices in place of each group's parameters, tp cuts, pp keeps a
stage's, ep an expert's, ZeRO-3 shards. Each case is also compared with one process training
one group of every parameter: the groups change the result by far more than the tolerance, so
a layout that dropped a group's options would fail.
"""

import pytest

from reference import reference_run
from tests_support import LayoutRuns, assert_equivalent, parameter_vector_error, selected_cases

STEPS = 4
GROUPS = ("--optimizer-groups", "decay")
# (nproc, zero, tp, extra script args)
FAST = [
    (2, 1, 1, ()),  # ZeRO-1 over 2 ranks: the optimizer holds flat slices of each group
    (2, 3, 1, ("--build", "meta")),  # ZeRO-3 on a meta build
    (2, 1, 2, ("--sp",)),  # tp + SP
]
EXTENDED = [
    (2, 2, 1, ()),
    (2, 0, 1, ()),
    (2, 1, 1, ("--pp", "2", "--microbatches", "2")),
    (2, 1, 1, ("--cp", "2")),
    (2, 1, 1, ("--ep", "2", "--model", "tiny_moe")),
    (2, 3, 2, ("--ac", "full")),
]
PARAMS = "nproc,zero,tp,extra"


def layout_case(test_name: str, params: dict):
    if not test_name.startswith("test_parameter_groups_"):
        return None
    key = tuple(params[name] for name in PARAMS.split(","))
    nproc, zero, tp, extra = key
    return key, (nproc, dict(zero=zero, steps=STEPS, tp=tp, extra=(*GROUPS, *extra)))


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    return LayoutRuns(tmp_path_factory.mktemp("groups"), selected_cases(request, layout_case))


def check(runs, nproc, zero, tp, extra):
    result, params = runs[(nproc, zero, tp, extra)]
    value = {flag: extra[extra.index(flag) + 1] for flag in ("--model", "--pp", "--cp") if flag in extra}
    model = value.get("--model", "tiny")
    data_ranks = nproc // (tp * int(value.get("--pp", 1)) * int(value.get("--cp", 1)))
    ref_losses, ref_params = reference_run(STEPS, data_ranks, model=model, optimizer_groups="decay")
    assert_equivalent(result["losses"], params, ref_losses, ref_params)
    _, one_group = reference_run(STEPS, data_ranks, model=model)
    assert parameter_vector_error(params, one_group) > 1e-3  # the groups' options made a difference


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(PARAMS, FAST)
def test_parameter_groups_train_as_in_one_process(runs, nproc, zero, tp, extra):
    check(runs, nproc, zero, tp, extra)


@pytest.mark.distributed
@pytest.mark.extended
@pytest.mark.timeout(400)
@pytest.mark.parametrize(PARAMS, EXTENDED)
def test_parameter_groups_train_as_in_one_process_extended(runs, nproc, zero, tp, extra):
    check(runs, nproc, zero, tp, extra)

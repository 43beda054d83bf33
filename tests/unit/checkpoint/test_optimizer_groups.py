"""Parameter groups recorded by name over every rank, and given back to another layout's groups."""

import pytest
import torch

from lightning_5d.checkpoint.optimizer_groups import (
    follow_groups,
    local_groups,
    merge_groups,
    merge_nontensor,
    stored_options,
)

DECAY, NO_DECAY = {"lr": 1.0, "weight_decay": 0.1}, {"lr": 1.0, "weight_decay": 0.0}
EMBEDDING, HEAD = {"lr": 0.3, "weight_decay": 0.0}, {"lr": 0.5, "weight_decay": 0.05}


def state(*groups):
    return {"state": {}, "param_groups": [{**options, "params": names} for options, names in groups]}


# pp2 x tp2: ranks 0-1 the first stage, 2-3 the last; tp ranks hold the same names.
FIRST = [state((EMBEDDING, ["embed"]), (DECAY, ["l0.w"]), (NO_DECAY, ["l0.norm"]))]
LAST = [state((HEAD, ["head"]), (DECAY, ["l1.w"]), (NO_DECAY, ["l1.norm", "norm"]))]


def test_groups_of_every_stage_are_recorded_once_each_and_every_name_finds_its_group():
    (options, group_of), = merge_groups([local_groups(s) for s in (FIRST, FIRST, LAST, LAST)])
    assert options == [EMBEDDING, DECAY, NO_DECAY, HEAD]  # the stages' "decay" is one group
    assert group_of == {"embed": 0, "l0.w": 1, "l0.norm": 2, "head": 3, "l1.w": 1, "l1.norm": 2, "norm": 2}


def test_each_layout_gets_its_groups_options_by_name_whatever_their_order():
    (options, group_of), = merge_groups([local_groups(s) for s in (FIRST, LAST)])
    # One process: another order of the groups, each group whole.
    mine = [({"lr": 9.0}, ["l0.norm", "l1.norm", "norm"]), ({"lr": 9.0}, ["head"]),
            ({"lr": 9.0}, ["embed"]), ({"lr": 9.0}, ["l0.w", "l1.w"]), ({"lr": 9.0}, [])]  # fmt: skip
    chosen, problem = stored_options(mine, options, group_of)
    assert problem is None and chosen == [NO_DECAY, HEAD, EMBEDDING, DECAY, {"lr": 9.0}]  # an empty group keeps its own


def test_a_group_that_was_split_or_holds_unknown_parameters_is_refused_naming_them():
    (options, group_of), = merge_groups([local_groups(s) for s in (FIRST, LAST)])
    _, problem = stored_options([({}, ["l0.w", "l0.norm"])], options, group_of)
    assert "parameter group 0 (2 parameters) was 2 groups in the checkpoint (group 1: l0.w; group 2: l0.norm)" in problem
    _, problem = stored_options([({}, ["l0.w", "adapter.a", "adapter.b"])], options, group_of)
    assert "holds parameters the checkpoint's optimizer did not (adapter.a, adapter.b)" in problem


def test_per_parameter_plain_state_is_merged_over_the_stages():
    merged = merge_nontensor([[{"embed": {"step": 3}}], [{"head": {"step": 3}}], [{"embed": {"step": 7}}]])
    assert merged == [{"embed": {"step": 3}, "head": {"step": 3}}]


def test_a_tensor_option_compares_by_value():
    a, b = {"lr": torch.tensor(0.1)}, {"lr": torch.tensor(0.1)}
    (options, _), = merge_groups([[[(a, ["x"])]], [[(b, ["y"])]]])
    assert len(options) == 1


def scheduler_states(make):
    """A scheduler's state on a 3-group optimizer (rank 0's, as Lightning saves it), and a 2-group optimizer."""
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(3)]
    saved = torch.optim.SGD([{"params": [p], "lr": lr} for p, lr in zip(params, (0.3, 1.0, 1.0))])
    scheduler = make(saved)
    saved.step(), scheduler.step()
    other = torch.optim.SGD([{"params": [p], "lr": lr} for p, lr in zip(params[:2], (0.5, 1.0))])
    return scheduler.state_dict(), other, make


@pytest.mark.parametrize("make", [
    lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda step: min(1.0, (step + 1) / 4)),
    lambda o: torch.optim.lr_scheduler.SequentialLR(o, [torch.optim.lr_scheduler.LinearLR(o, 0.5, total_iters=2),
                                                        torch.optim.lr_scheduler.StepLR(o, 2)], milestones=[2]),
])  # fmt: skip
def test_a_scheduler_state_takes_its_per_group_lists_from_this_ranks_groups(make):
    stored, other, make = scheduler_states(make)
    mine = make(other)
    for group in other.param_groups:  # as the optimizer's restore leaves them (options of its own groups)
        group["lr"] = group["initial_lr"] * 0.5
    follow_groups(stored, other.param_groups)
    mine.load_state_dict(stored)
    assert all(inner.base_lrs == [0.5, 1.0] for inner in getattr(mine, "_schedulers", [mine]))
    assert mine.get_last_lr() == [0.25, 0.5]
    other.step(), mine.step()  # no length mismatch at the next step


def test_a_plateau_schedulers_single_valued_list_takes_the_groups_count():
    stored = {"min_lrs": [0.0, 0.0, 0.0], "_last_lr": [1.0, 1.0, 1.0]}
    follow_groups(stored, [{"lr": 0.1}, {"lr": 0.2}])
    assert stored == {"min_lrs": [0.0, 0.0], "_last_lr": [0.1, 0.2]}

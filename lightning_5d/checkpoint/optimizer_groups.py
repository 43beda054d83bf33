"""Which parameter group each parameter's optimizer options belong to, over every rank.

``configure_optimizers`` runs on the module a rank holds: under pp a stage builds the groups of
its own parameters only (the first stage has an embedding group, the last does not), and ep
ranks hold different experts. A checkpoint that kept rank 0's list of groups, matched by
position, refused a resume in the same pp layout ("3 parameter groups, this one 2") and, where
the counts happened to agree, gave a later stage's groups the first stage's options (learning
rate, weight decay) without a word.

So the save records, per optimizer, every rank's groups' options once each and the group of
every parameter by name; a resume gives each of its groups the options of the stored group its
parameters were in, whatever the layouts. A group whose parameters were stored in several groups
(or not at all) is refused, naming them: configure_optimizers must group as the saved run did.
Per-parameter non-tensor optimizer state (an int step count) is merged over the ranks the same
way, and the learning-rate schedulers' per-group lists (rank 0's, as Lightning saves them) are
made each rank's from its restored groups (:func:`follow_groups`). Checkpoints written before
this keep rank 0's list, matched by position as before.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from torch import Tensor

# One optimizer's record: the distinct groups' options, and each parameter name's group in that list.
Record = tuple[list[dict[str, Any]], dict[str, int]]


def local_groups(states: Sequence[Mapping[str, Any]]) -> list[list[tuple[dict[str, Any], list[str]]]]:
    """Per optimizer state (its ``param_groups`` name their parameters): (options, names) per group."""
    return [[({k: v for k, v in g.items() if k != "params"}, list(g["params"])) for g in s["param_groups"]]
            for s in states]  # fmt: skip


def merge_groups(everyone: Sequence[list[list[tuple[dict[str, Any], list[str]]]]]) -> list[Record]:
    """Every rank's :func:`local_groups`, in rank order, as one :data:`Record` per optimizer.

    Ranks holding the same parameter (tp pieces, data-parallel replicas) hold it with the same
    options; the first rank's are kept. Groups with equal options on different ranks (a stage's
    "decay" and the next stage's) stay one group.
    """
    records: list[Record] = []
    for index in range(len(everyone[0])):
        options: list[dict[str, Any]] = []
        group_of: dict[str, int] = {}
        for rank in everyone:
            for hyper, names in rank[index]:
                if not names:
                    continue
                where = next((i for i, o in enumerate(options) if _same(o, hyper)), None)
                if where is None:
                    options.append(hyper)
                    where = len(options) - 1
                for name in names:
                    group_of.setdefault(name, where)
        records.append((options, group_of))
    return records


def merge_nontensor(everyone: Sequence[list[dict[str, dict[str, Any]]]]) -> list[dict[str, dict[str, Any]]]:
    """Per optimizer, every rank's per-parameter non-tensor state, by name (the first rank's wins)."""
    merged: list[dict[str, dict[str, Any]]] = [{} for _ in everyone[0]]
    for rank in everyone:
        for index, stats in enumerate(rank):
            for name, values in stats.items():
                merged[index].setdefault(name, values)
    return merged


def stored_options(
    groups: Sequence[tuple[dict[str, Any], list[str]]], options: Sequence[dict[str, Any]], group_of: Mapping[str, int]
) -> tuple[list[dict[str, Any]] | None, str | None]:
    """For this rank's groups ((options, names) each): the stored options of each, or a problem."""
    chosen: list[dict[str, Any]] = []
    for i, (own, names) in enumerate(groups):
        if not names:
            chosen.append(own)  # an empty group: nothing to restore
            continue
        missing = [n for n in names if n not in group_of]
        if missing:
            return None, (
                f"parameter group {i} holds parameters the checkpoint's optimizer did not ({_some(missing)}); "
                f"configure_optimizers must give the optimizer the parameters it had when the checkpoint was saved."
            )
        stored = sorted({group_of[n] for n in names})
        if len(stored) > 1:
            split = "; ".join(f"group {g}: {_some([n for n in names if group_of[n] == g])}" for g in stored)
            return None, (
                f"parameter group {i} ({len(names)} parameters) was {len(stored)} groups in the checkpoint ({split}); "
                f"configure_optimizers must build the groups the checkpoint was saved with to resume."
            )
        chosen.append(options[stored[0]])
    return chosen, None


def follow_groups(scheduler_state: dict[str, Any], param_groups: Sequence[Mapping[str, Any]]) -> None:
    """A stored learning-rate scheduler state, made this rank's: its per-group lists from the groups.

    Lightning saves the scheduler states rank 0 holds; under pp a later stage's scheduler has
    other groups (torch's ``zip(strict=True)`` then fails at the first step, or, where the counts
    agree, each group continues with another's base learning rate). ``base_lrs`` and ``_last_lr``
    are what torch's schedulers derive from their optimizer's groups (``initial_lr``, ``lr``),
    restored by name before this. Per-group lists of one value (``ReduceLROnPlateau``'s
    ``min_lrs``, ``CyclicLR``'s ``max_lrs`` when all equal) take the groups' count; chained and
    sequential schedulers' inner states are made the same way.
    """
    if isinstance(scheduler_state.get("base_lrs"), list):
        scheduler_state["base_lrs"] = [g.get("initial_lr", g["lr"]) for g in param_groups]
    if isinstance(scheduler_state.get("_last_lr"), list):
        scheduler_state["_last_lr"] = [g["lr"] for g in param_groups]
    for key in ("min_lrs", "max_lrs"):
        values = scheduler_state.get(key)
        if isinstance(values, list) and values and len(values) != len(param_groups) and len(set(values)) == 1:
            scheduler_state[key] = [values[0]] * len(param_groups)
    for inner in scheduler_state.get("_schedulers") or []:
        if isinstance(inner, dict):
            follow_groups(inner, param_groups)


def _same(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for key, value in a.items():
        other = b[key]
        if isinstance(value, Tensor) or isinstance(other, Tensor):  # a tensor lr (capturable optimizers)
            if not (isinstance(value, Tensor) and isinstance(other, Tensor) and value.equal(other)):
                return False
        elif value != other:
            return False
    return True


def _some(names: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"

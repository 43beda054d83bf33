"""What a mixture-of-experts layer is made of, judged from its modules.

Every source that finds a MoE uses these rules: the experts are either a list of expert
MLPs (``nn.ModuleList``) or one module holding stacked ``[num_experts, ...]`` weights
(Hugging Face transformers 5.x ``MixtralExperts``); the router is a linear layer, or any
module whose ``weight`` is ``[num_experts, hidden]`` (``MixtralTopKRouter``), beside the
experts; a shared expert and its gate (Qwen2-MoE) are siblings with ``shared`` in
their names.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_5d.plan import kinds, paths
from lightning_5d.plan.model_plan import ExpertsKind

# Leaf names of routers, in order of preference, when a MoE module has several candidates.
ROUTER_NAMES = ("router", "gate")
# Config attributes that hold the number of experts each token is sent to.
TOP_K_CONFIG_NAMES = ("num_experts_per_tok", "experts_top_k")
_EXPERT_LISTS = (nn.ModuleList, nn.Sequential)


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


def _int_attribute(obj: Any, name: str) -> int | None:
    try:
        return _positive_int(getattr(obj, name, None))
    except (AttributeError, TypeError, ValueError, KeyError, RuntimeError):  # a property that cannot be computed
        return None


def _stacked_weights(module: nn.Module) -> list[nn.Parameter]:
    """The module's own parameters of 3 or more dimensions (one slice per expert)."""
    if isinstance(module, (*_EXPERT_LISTS, nn.ModuleDict, nn.modules.conv._ConvNd)):
        return []
    return [p for p in module.parameters(recurse=False) if p.dim() >= 3]


def experts_kind(module: nn.Module) -> ExpertsKind | None:
    """MODULE_LIST, GROUPED, or None for a module that holds no experts."""
    if isinstance(module, _EXPERT_LISTS):
        return ExpertsKind.MODULE_LIST
    if _grouped_count(module) is not None:
        return ExpertsKind.GROUPED
    return None


def _grouped_count(module: nn.Module) -> int | None:
    stacked = _stacked_weights(module)
    if not stacked:
        return None
    declared = _int_attribute(module, "num_experts")
    if declared is not None:
        return declared
    leading = {int(p.shape[0]) for p in stacked}
    return leading.pop() if len(leading) == 1 else None


def expert_count(module: nn.Module) -> int | None:
    """How many experts ``module`` holds: the list's length, else the grouped module's
    ``num_experts`` or the leading dimension of its stacked weights; None if it holds none."""
    if isinstance(module, _EXPERT_LISTS):
        return len(module)
    return _grouped_count(module)


def looks_grouped(path: str, module: nn.Module) -> bool:
    """A grouped experts module the structural detector may take without being told:
    it declares ``num_experts`` or is named for its experts."""
    if _grouped_count(module) is None:
        return False
    return _int_attribute(module, "num_experts") is not None or "expert" in paths.leaf(path).lower()


def is_router(module: nn.Module) -> bool:
    """A linear layer, or a module whose own ``weight`` is 2-D ([num_experts, hidden])."""
    if kinds.is_projection(module):
        return True
    weight = getattr(module, "weight", None)
    return isinstance(weight, nn.Parameter) and weight.dim() == 2 and not kinds.is_embedding(module)


def router_rows(module: nn.Module) -> int | None:
    """The number of experts a router scores (its output features), None for a non-router."""
    if kinds.is_projection(module):
        return kinds.out_features(module)
    if is_router(module):
        return int(module.weight.shape[0])
    return None


def _children(module: nn.Module, moe: str, taken: set[str]) -> dict[str, nn.Module]:
    """The children of the MoE ``module`` at path ``moe``, by their full paths, less ``taken``."""
    children = ((paths.join(moe, name), child) for name, child in module.named_children())
    return {p: m for p, m in children if p not in taken}


def router_beside(
    module: nn.Module,
    moe: str,
    experts: str,
    count: int | None,
    *,
    trust_names: bool = False,
) -> str | None:
    """The router among the children of the MoE ``module`` (at path ``moe``) for ``count`` experts.

    A child named ``router`` or ``gate`` comes first. With ``trust_names`` (the experts
    were named by a plan) it is taken whatever it scores, so that a wrong count is
    reported rather than the MoE silently dropped; otherwise every candidate must score
    ``count`` experts.
    """
    children = {p: m for p, m in _children(module, moe, {experts}).items() if is_router(m)}
    by_name = sorted(
        (p for p in children if paths.leaf(p).lower() in ROUTER_NAMES),
        key=lambda p: ROUTER_NAMES.index(paths.leaf(p).lower()),
    )
    if trust_names and by_name:
        return by_name[0]
    ordered = by_name + [p for p in children if p not in by_name]
    scoring = [p for p in ordered if count is not None and router_rows(children[p]) == count]
    return scoring[0] if scoring else None


def shared_beside(module: nn.Module, moe: str, taken: set[str]) -> tuple[str | None, str | None]:
    """(shared experts, shared expert gate) among the children of the MoE ``module`` at path
    ``moe``, less the ``taken`` paths: ``shared`` in the name;
    the gate is a linear layer with ``gate`` in its name as well (Qwen2-MoE's ``shared_expert_gate``)."""
    shared: list[str] = []
    gates: list[str] = []
    for path, child in _children(module, moe, taken).items():
        name = paths.leaf(path).lower()
        if "shared" not in name:
            continue
        if "gate" in name:
            if kinds.is_projection(child):
                gates.append(path)
        else:
            shared.append(path)
    return (shared[0] if shared else None, gates[0] if gates else None)


def top_k(moe: nn.Module, router: nn.Module, config: Any) -> int:
    """Experts per token: the MoE module's ``top_k``, the router's, the config's, else 0."""
    for module in (moe, router):
        value = _int_attribute(module, "top_k")
        if value is not None:
            return value
    if config is not None:
        for name in TOP_K_CONFIG_NAMES:
            value = _int_attribute(config, name)
            if value is not None:
                return value
    return 0

"""The second source: the parallel plans a Hugging Face model publishes about itself.

``config.base_model_tp_plan`` (and the model's ``_tp_plan``) say which layers are
column- and row-parallel; ``base_model_pp_plan`` names the embedding, the block list
and the final norm; ``base_model_ep_plan`` the experts (and, in older versions, the
routers). Their styles are translated into roles here; the layer's name decides whether
a column-parallel layer belongs to the attention or to the MLP.

transformers 5.x names only the experts (``"layers.*.mlp.experts": "ep_dispatch_experts"``
and their stacked weights, ``"layers.*.mlp.experts.gate_up_proj": "grouped_gemm"``); the
MoE module is their parent, and its router, shared expert and shared expert gate are
found beside them by name (:mod:`lightning_5d.plan.moe_parts`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from lightning_5d.plan import kinds, moe_parts, paths
from lightning_5d.plan.heads import from_object
from lightning_5d.plan.patterns import RoleMap
from lightning_5d.plan.roles import Role, RoleSpec
from lightning_5d.plan.structural import K_NAMES, Q_NAMES, QKV_NAMES, V_NAMES

_ATTENTION_COLUMN = (
    (Q_NAMES, Role.Q),
    (K_NAMES, Role.K),
    (V_NAMES, Role.V),
    (QKV_NAMES, Role.QKV),
)


def find(root: nn.Module) -> RoleMap:
    """Roles from the outermost Hugging Face model inside ``root`` (empty if none publishes plans)."""
    for prefix, model in root.named_modules():
        config = vars(model).get("config")
        if config is not None and hasattr(config, "base_model_tp_plan"):
            return _role_map(root, prefix, model, config)
    return RoleMap({})


def _role_map(root: nn.Module, prefix: str, model: nn.Module, config: Any) -> RoleMap:
    base = _base_model_path(model, prefix)
    tp = _prefixed(getattr(config, "base_model_tp_plan", None), base)
    tp |= _prefixed(vars(model).get("_tp_plan") or getattr(type(model), "_tp_plan", None), prefix)
    pp = _prefixed(getattr(config, "base_model_pp_plan", None), base)
    pp |= _prefixed(vars(model).get("_pp_plan"), prefix)
    ep = _prefixed(getattr(config, "base_model_ep_plan", None), base)
    ep |= _prefixed(vars(model).get("_ep_plan"), prefix)
    if not (tp or pp or ep):
        return RoleMap({})
    roles = _tp_roles(tp) | _ep_roles(root, ep) | _pp_roles(root, pp) | _embedding_roles(model, prefix)
    counts = from_object(config, paths.join(prefix, "config"))
    return RoleMap(roles, counts)


def _base_model_path(model: nn.Module, prefix: str) -> str:
    name = getattr(model, "base_model_prefix", "")
    if name and isinstance(getattr(model, name, None), nn.Module):
        return paths.join(prefix, name)
    return prefix


def _prefixed(plan: Mapping[str, Any] | None, prefix: str) -> dict[str, Any]:
    return {paths.join(prefix, key): value for key, value in (plan or {}).items()}


def _tp_roles(plan: Mapping[str, str]) -> dict[str, RoleSpec]:
    in_blocks = {k: str(s) for k, s in plan.items() if "*" in k and "experts" not in k.split(".")}
    roles: dict[str, RoleSpec] = {}
    attention_parents: set[str] = set()
    for key, style in in_blocks.items():
        if "colwise" not in style:
            continue
        role = _attention_column_role(key)
        if role is not None:
            attention_parents.add(paths.parent(key))
            roles[key] = RoleSpec(role)
        elif not _looks_like_attention(paths.parent(key)):
            # An attention layer with an unfamiliar name is left to later sources
            # rather than taken for an MLP layer.
            roles[key] = RoleSpec(Role.MLP_COLUMN)
    for key, style in in_blocks.items():
        if "rowwise" not in style:
            continue
        parent = paths.parent(key)
        in_attention = parent in attention_parents or _looks_like_attention(parent)
        roles[key] = RoleSpec(Role.O if in_attention else Role.MLP_ROW)
    return roles


def _attention_column_role(key: str) -> Role | None:
    name = paths.leaf(key).lower()
    for names, role in _ATTENTION_COLUMN:
        if name in names:
            return role
    return None


def _looks_like_attention(path: str) -> bool:
    name = paths.leaf(path).lower()
    return "attn" in name or "attention" in name


def _ep_roles(root: nn.Module, plan: Mapping[str, str]) -> dict[str, RoleSpec]:
    roles: dict[str, RoleSpec] = {}
    experts: dict[str, None] = {}  # patterns of the experts modules, in plan order
    for key, style in plan.items():
        style = str(style)
        if "router" in style:
            roles[key] = RoleSpec(Role.ROUTER)
        elif paths.leaf(key) == "experts" or "experts" in style:
            experts[key] = None
        elif "grouped_gemm" in style:
            experts[paths.parent(key)] = None  # a stacked weight of the experts module
    has_routers = any(spec.role is Role.ROUTER for spec in roles.values())
    modules = dict(root.named_modules())
    for pattern in experts:
        regex = paths.compile_pattern(pattern)
        for path, module in modules.items():
            if path and regex.fullmatch(path) and moe_parts.experts_kind(module) is not None:
                roles |= _moe_roles(modules, path, has_routers)
    return roles


def _moe_roles(modules: Mapping[str, nn.Module], experts: str, has_routers: bool) -> dict[str, RoleSpec]:
    """Roles of one MoE module, from the path of its experts (all paths from the root)."""
    moe = paths.parent(experts)
    container = modules[moe]
    roles = {experts: RoleSpec(Role.EXPERTS)}
    if moe:
        roles[moe] = RoleSpec(Role.MOE)
    router = None
    if not has_routers:
        count = moe_parts.expert_count(modules[experts])
        router = moe_parts.router_beside(container, moe, experts, count, trust_names=True)
        if router is not None:
            roles[router] = RoleSpec(Role.ROUTER)
    shared, gate = moe_parts.shared_beside(container, moe, {experts} | ({router} if router else set()))
    if shared is not None:
        roles[shared] = RoleSpec(Role.SHARED_EXPERTS)
    if gate is not None:
        roles[gate] = RoleSpec(Role.SHARED_EXPERT_GATE)
    return roles


def _pp_roles(root: nn.Module, plan: Mapping[str, Any]) -> dict[str, RoleSpec]:
    """A pipeline plan lists the stages' parts in order; their kinds say which is which."""
    roles: dict[str, RoleSpec] = {}
    for key in plan:
        module = _submodule(root, key)
        if module is None:
            continue
        if kinds.is_block_list(module):
            roles[key] = RoleSpec(Role.BLOCKS)
        elif kinds.is_norm(module):
            roles[key] = RoleSpec(Role.FINAL_NORM)
    return roles


def _embedding_roles(model: nn.Module, prefix: str) -> dict[str, RoleSpec]:
    roles: dict[str, RoleSpec] = {}
    for getter, role in (
        ("get_input_embeddings", Role.EMBEDDING),
        ("get_output_embeddings", Role.HEAD),
    ):
        if not hasattr(model, getter):
            continue
        try:
            layer = getattr(model, getter)()
        except NotImplementedError:  # PreTrainedModel's default for models without one
            continue
        path = _path_of(model, layer)
        if path is not None:
            roles[paths.join(prefix, path)] = RoleSpec(role)
    return roles


def _submodule(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


def _path_of(model: nn.Module, layer: Any) -> str | None:
    if not isinstance(layer, nn.Module):
        return None
    for path, module in model.named_modules():
        if module is layer and path:
            return path
    return None

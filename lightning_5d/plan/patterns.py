"""Resolve a mapping of module-path patterns to roles against a real module tree.

The explicit, published and registry sources all speak this language. The explicit
plan is resolved STRICTly (every mistake is an error naming the pattern); the others
are LENIENT, since a published or registry plan may name modules a particular model
does not have (no ``lm_head`` in a headless model, no ``moe`` in a dense block).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from torch import nn

from lightning_5d.plan import kinds, moe_parts, paths
from lightning_5d.plan.heads import HeadCounts
from lightning_5d.plan.hints import BlockHints, TopHints
from lightning_5d.plan.roles import (
    ATTENTION_ARGUMENTS,
    CONTAINER_ROLES,
    MULTI_ROLES,
    Expects,
    PlanConflictError,
    Role,
    RoleSpec,
    Scope,
    expects,
    scope,
)


class Strictness(str, Enum):
    STRICT = "strict"  # every problem is a PlanConflictError
    LENIENT = "lenient"  # problems drop the offending entry


@dataclass(frozen=True)
class Assignment:
    path: str  # from the discovered module
    spec: RoleSpec
    pattern: str  # the pattern that matched, for error messages


TOP_FIELD = {
    Role.EMBEDDING: "embedding",
    Role.POSITION_EMBEDDING: "position_embedding",
    Role.BLOCKS: "blocks",
    Role.FINAL_NORM: "final_norm",
    Role.HEAD: "head",
}
BLOCK_FIELD = {
    Role.ATTENTION: "attention",
    Role.Q: "q",
    Role.K: "k",
    Role.V: "v",
    Role.KV: "kv",
    Role.QKV: "qkv",
    Role.O: "o",
    Role.MLP: "mlp",
    Role.MLP_COLUMN: "mlp_column",
    Role.MLP_ROW: "mlp_row",
    Role.NORM: "norms",
    Role.MOE: "moe",
    Role.ROUTER: "router",
    Role.EXPERTS: "experts",
    Role.SHARED_EXPERTS: "shared_experts",
    Role.SHARED_EXPERT_GATE: "shared_expert_gate",
}


def fits(module: nn.Module, role: Role) -> bool:
    """Whether ``module`` is the kind of module ``role`` needs."""
    need = expects(role)
    if need is Expects.PROJECTION:
        return kinds.is_projection(module)
    if need is Expects.EMBEDDING:
        return kinds.is_embedding(module)
    if need is Expects.BLOCK_LIST:
        return kinds.is_block_list(module) and len(module) > 0
    if need is Expects.ROUTER:
        return moe_parts.is_router(module)
    if need is Expects.EXPERTS:
        return moe_parts.experts_kind(module) is not None
    return True


def assign(root: nn.Module, roles: Mapping[str, RoleSpec], strictness: Strictness) -> list[Assignment]:
    """Every (module, role) the patterns select, checked for kind and conflicts."""
    modules = {name: m for name, m in root.named_modules() if name}
    found: dict[str, Assignment] = {}
    for pattern, spec in roles.items():
        for path in _matches(pattern, modules, spec, strictness):
            module = modules[path]
            if not fits(module, spec.role):
                _fail_or_skip(strictness, _wrong_kind(pattern, spec, path, module))
                continue
            earlier = found.get(path)
            if earlier is None:
                found[path] = Assignment(path, spec, pattern)
            elif earlier.spec.role is not spec.role:
                _fail_or_skip(strictness, _two_roles(earlier, Assignment(path, spec, pattern)))
    order = {name: i for i, name in enumerate(modules)}
    return sorted(found.values(), key=lambda a: order[a.path])


def _matches(
    pattern: str,
    modules: Mapping[str, nn.Module],
    spec: RoleSpec,
    strictness: Strictness,
) -> list[str]:
    regex = paths.compile_pattern(pattern)
    hits = [name for name in modules if regex.fullmatch(name)]
    if not hits and strictness is Strictness.STRICT:
        near = difflib.get_close_matches(pattern.replace("*", "0"), list(modules), n=3)
        hint = f" Modules with similar names: {', '.join(near)}." if near else ""
        raise PlanConflictError(
            f"model_plan pattern {pattern!r} (role {spec}) matches no module of the model.{hint} "
            f"Patterns are dotted paths from the LightningModule; `*` stands for one path "
            f"component (a block index), `**` for any number; print(model) shows the names."
        )
    return hits


def top_hints(assignments: list[Assignment], strictness: Strictness) -> TopHints:
    hints = TopHints()
    for a in assignments:
        if scope(a.spec.role) is not Scope.MODEL:
            continue
        name = TOP_FIELD[a.spec.role]
        current = getattr(hints, name)
        if current is None:
            setattr(hints, name, a.path)
        elif current != a.path:
            _fail_or_skip(
                strictness,
                f"model_plan role {a.spec.role.value!r} is on two modules, {current!r} and "
                f"{a.path!r} (pattern {a.pattern!r}); a model has one {a.spec.role.value}. "
                f"Make the pattern match only one of them.",
            )
    return hints


def block_hints(assignments: list[Assignment], blocks: str, strictness: Strictness) -> dict[int, BlockHints]:
    """Block-scope assignments, keyed by block index, with paths relative to the block."""
    out: dict[int, BlockHints] = {}
    for a in assignments:
        if scope(a.spec.role) is not Scope.BLOCK:
            continue
        located = paths.block_index(a.path, blocks) if blocks else None
        if located is None or not (located[1] or a.spec.role in CONTAINER_ROLES):
            _fail_or_skip(
                strictness,
                f"model_plan pattern {a.pattern!r} puts block role {a.spec.role.value!r} on "
                f"{a.path!r}, which is not inside a block of {blocks or '(no blocks found)'!r}. "
                f"Block roles name modules inside the blocks, e.g. '{blocks or '<blocks>'}.*.<name>'.",
            )
            continue
        index, inside = located
        _set_block_role(out.setdefault(index, BlockHints()), a, inside, strictness)
    return out


def _set_block_role(hints: BlockHints, a: Assignment, inside: str, strictness: Strictness) -> None:
    name = BLOCK_FIELD[a.spec.role]
    if a.spec.role in MULTI_ROLES:
        setattr(hints, name, getattr(hints, name) + (inside,))
    else:
        current = getattr(hints, name)
        if current is not None and current != inside:
            _fail_or_skip(
                strictness,
                f"model_plan role {a.spec.role.value!r} matches two modules in one block, "
                f"{current!r} and {inside!r} (pattern {a.pattern!r}); it names one module per "
                f"block. Make the pattern match only one of them.",
            )
            return
        setattr(hints, name, inside)
    for key, field_name in ATTENTION_ARGUMENTS.items():
        value = a.spec.argument(key)
        if value is not None:
            setattr(hints, field_name, value)


def _wrong_kind(pattern: str, spec: RoleSpec, path: str, module: nn.Module) -> str:
    return (
        f"model_plan pattern {pattern!r} gives role {spec.role.value!r} to {path!r}, a "
        f"{kinds.describe_kind(module)}; that role needs {expects(spec.role).value}. "
        f"Point the pattern at the right module (print(model) shows them)."
    )


def _two_roles(first: Assignment, second: Assignment) -> str:
    return (
        f"module {first.path!r} is matched by model_plan patterns {first.pattern!r} "
        f"(role {first.spec.role.value!r}) and {second.pattern!r} (role "
        f"{second.spec.role.value!r}); a module has one role. Narrow one of the patterns."
    )


def _fail_or_skip(strictness: Strictness, message: str) -> None:
    if strictness is Strictness.STRICT:
        raise PlanConflictError(message)


@dataclass(frozen=True)
class RoleMap:
    """What a pattern-speaking source says: roles by pattern, and head counts for every block."""

    roles: Mapping[str, RoleSpec]
    heads: HeadCounts = field(default_factory=HeadCounts)
    notes: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.roles)

"""The roles a module can play in a plan, and the grammar users write them in.

A role is ``name`` or ``name(key=value, ...)``; only ``attention`` takes arguments,
the head counts::

    "model.layers.*.attn": "attention(heads=8, kv_heads=2)"
    "model.layers.*.attn.wqkv": "attention.qkv"
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from lightning_5d.plan.blocks import ModelMappingError


class PlanConflictError(ModelMappingError):
    """An explicit plan that contradicts itself or the model; the message names the pattern."""


class Role(str, Enum):
    EMBEDDING = "embedding"
    POSITION_EMBEDDING = "position_embedding"
    BLOCKS = "blocks"
    FINAL_NORM = "final_norm"
    HEAD = "head"
    ATTENTION = "attention"
    Q = "attention.q"
    K = "attention.k"
    V = "attention.v"
    KV = "attention.kv"  # fused [k|v] beside a separate attention.q
    QKV = "attention.qkv"
    O = "attention.o"
    MLP = "mlp"
    MLP_COLUMN = "mlp.column"
    MLP_ROW = "mlp.row"
    NORM = "norm"
    MOE = "moe"
    ROUTER = "moe.router"
    EXPERTS = "moe.experts"
    SHARED_EXPERTS = "moe.shared_experts"
    SHARED_EXPERT_GATE = "moe.shared_expert_gate"


class Scope(str, Enum):
    """Whether a role's path is from the discovered module or from its block."""

    MODEL = "model"
    BLOCK = "block"


class Expects(str, Enum):
    """The kind of module a role must be put on."""

    PROJECTION = "a linear layer (nn.Linear or Conv1D)"
    EMBEDDING = "an nn.Embedding"
    BLOCK_LIST = "an nn.ModuleList of blocks (or an nn.ModuleDict keyed '0', '1', ...)"
    ROUTER = "a linear layer or a module with a 2-D weight ([num_experts, hidden])"
    EXPERTS = "an nn.ModuleList of experts or a module holding [num_experts, ...] weights"
    ANY = "any module"


MODEL_ROLES = frozenset({Role.EMBEDDING, Role.POSITION_EMBEDDING, Role.BLOCKS, Role.FINAL_NORM, Role.HEAD})
# A block may hold several of these (gate and up projections, two norms); every other
# role names at most one module per block.
MULTI_ROLES = frozenset({Role.MLP_COLUMN, Role.MLP_ROW, Role.NORM})
# Roles that may name a whole block (a block whose projections sit directly in it).
CONTAINER_ROLES = frozenset({Role.ATTENTION, Role.MLP, Role.MOE})

EXPECTS = {
    Role.EMBEDDING: Expects.EMBEDDING,
    Role.POSITION_EMBEDDING: Expects.EMBEDDING,
    Role.BLOCKS: Expects.BLOCK_LIST,
    Role.HEAD: Expects.PROJECTION,
    Role.Q: Expects.PROJECTION,
    Role.K: Expects.PROJECTION,
    Role.V: Expects.PROJECTION,
    Role.KV: Expects.PROJECTION,
    Role.QKV: Expects.PROJECTION,
    Role.O: Expects.PROJECTION,
    Role.MLP_COLUMN: Expects.PROJECTION,
    Role.MLP_ROW: Expects.PROJECTION,
    Role.ROUTER: Expects.ROUTER,
    Role.EXPERTS: Expects.EXPERTS,
    Role.SHARED_EXPERT_GATE: Expects.PROJECTION,
}

# Argument name in the role string -> field of the block hints it sets.
ATTENTION_ARGUMENTS = {
    "heads": "num_heads",
    "kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
}


def scope(role: Role) -> Scope:
    return Scope.MODEL if role in MODEL_ROLES else Scope.BLOCK


def expects(role: Role) -> Expects:
    return EXPECTS.get(role, Expects.ANY)


@dataclass(frozen=True)
class RoleSpec:
    role: Role
    arguments: tuple[tuple[str, int], ...] = ()

    def argument(self, name: str) -> int | None:
        return dict(self.arguments).get(name)

    def __str__(self) -> str:
        if not self.arguments:
            return self.role.value
        args = ", ".join(f"{k}={v}" for k, v in self.arguments)
        return f"{self.role.value}({args})"


_ROLE_RE = re.compile(r"^\s*([a-z_.]+)\s*(?:\((.*)\))?\s*$")


def parse_role(text: str, pattern: str = "") -> RoleSpec:
    """Parse ``"attention(heads=8, kv_heads=2)"``; errors name the pattern it was given for."""
    where = f" for pattern {pattern!r}" if pattern else ""
    match = _ROLE_RE.match(str(text))
    if match is None:
        raise PlanConflictError(
            f"cannot read role {text!r}{where}: write `role` or `role(key=value, ...)`, "
            f"e.g. 'attention(heads=8, kv_heads=2)'."
        )
    name, args = match.groups()
    try:
        role = Role(name)
    except ValueError:
        valid = ", ".join(r.value for r in Role)
        raise PlanConflictError(f"unknown role {name!r}{where}; valid roles: {valid}.") from None
    return RoleSpec(role, _parse_arguments(role, args or "", text, where))


def _parse_arguments(role: Role, args: str, text: str, where: str) -> tuple[tuple[str, int], ...]:
    parsed: list[tuple[str, int]] = []
    for item in filter(None, (a.strip() for a in args.split(","))):
        key, eq, value = (s.strip() for s in item.partition("="))
        if role is not Role.ATTENTION:
            raise PlanConflictError(
                f"role {text!r}{where} takes no arguments; head counts go on the "
                f"'attention' role, e.g. 'attention(heads=8, kv_heads=2)'."
            )
        if not eq or key not in ATTENTION_ARGUMENTS:
            raise PlanConflictError(
                f"cannot read argument {item!r} of role {text!r}{where}; 'attention' takes "
                f"{', '.join(k + '=<int>' for k in ATTENTION_ARGUMENTS)}."
            )
        if not value.isdigit() or int(value) <= 0:
            raise PlanConflictError(f"argument {key}={value!r} of role {text!r}{where} must be a positive integer.")
        parsed.append((key, int(value)))
    return tuple(parsed)

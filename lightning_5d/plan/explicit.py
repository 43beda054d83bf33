"""The first source: the user's ``model_plan``, a mapping of module-path patterns to roles.

Paths are dotted paths from the module handed to discovery (the LightningModule);
``*`` stands for one path component (the block index), ``**`` for any number::

    parallel:
      model_plan:
        "tok": embedding
        "stack": blocks
        "stack.*.att": attention(heads=4, kv_heads=2)
        "stack.*.att.wa": attention.qkv
        "stack.*.att.wb": attention.o

Unlike the other sources it is resolved strictly: a pattern that matches nothing, a
module given two roles, a role on the wrong kind of layer, or head counts that the
model's own config contradicts are errors naming the pattern.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from lightning_5d.plan.heads import declared
from lightning_5d.plan.patterns import Assignment, RoleMap
from lightning_5d.plan.roles import (
    ATTENTION_ARGUMENTS,
    PlanConflictError,
    Role,
    parse_role,
)


def role_map(explicit: Mapping[str, str]) -> RoleMap:
    roles = {}
    for pattern, role in explicit.items():
        if not isinstance(pattern, str) or not pattern:
            raise PlanConflictError(
                f"model_plan key {pattern!r} is not a module path pattern; keys are dotted "
                f"paths such as 'model.layers.*.self_attn'."
            )
        roles[pattern] = parse_role(str(role), pattern)
    return RoleMap(roles)


def check_heads(root: nn.Module, assignments: list[Assignment]) -> None:
    """Explicit head counts must agree with those the model declares itself."""
    for a in assignments:
        if a.spec.role is not Role.ATTENTION or not a.spec.arguments:
            continue
        model = declared(root, a.path)
        for key, field_name in ATTENTION_ARGUMENTS.items():
            given, own = a.spec.argument(key), getattr(model, field_name)
            if given is not None and own is not None and given != own:
                raise PlanConflictError(
                    f"model_plan pattern {a.pattern!r} gives {key}={given} for {a.path!r}, "
                    f"but the model declares {field_name}={own} ({model.where}). Drop "
                    f"{key}= from the role or make it {own}."
                )

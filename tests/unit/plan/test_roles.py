"""The role grammar: `role` or `attention(heads=H, kv_heads=KV, head_dim=D)`."""

import pytest

from lightning_5d.plan import PlanConflictError, Role
from lightning_5d.plan.roles import RoleSpec, Scope, parse_role, scope


def test_plain_and_dotted_roles():
    assert parse_role("embedding") == RoleSpec(Role.EMBEDDING)
    assert parse_role(" attention.qkv ") == RoleSpec(Role.QKV)
    assert parse_role("moe.shared_experts").role is Role.SHARED_EXPERTS


def test_attention_takes_head_counts():
    spec = parse_role("attention(heads=8, kv_heads=2, head_dim=64)")
    assert spec.role is Role.ATTENTION
    assert (spec.argument("heads"), spec.argument("kv_heads")) == (8, 2)
    assert spec.argument("head_dim") == 64
    assert str(spec) == "attention(heads=8, kv_heads=2, head_dim=64)"
    assert parse_role("attention()") == RoleSpec(Role.ATTENTION)


def test_scopes():
    assert scope(Role.HEAD) is Scope.MODEL and scope(Role.BLOCKS) is Scope.MODEL
    assert scope(Role.NORM) is Scope.BLOCK and scope(Role.O) is Scope.BLOCK


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "atention",
            r"unknown role 'atention' for pattern 'p'; valid roles: embedding",
        ),
        ("mlp.column(heads=2)", r"takes no arguments"),
        ("attention(heads=2, groups=4)", r"cannot read argument 'groups=4'"),
        ("attention(heads)", r"cannot read argument 'heads'"),
        ("attention(heads=0)", r"heads='0'.*must be a positive integer"),
        ("attention(heads=two)", r"must be a positive integer"),
        ("attention[heads=2]", r"cannot read role"),
    ],
)
def test_bad_roles_name_the_pattern(text, message):
    with pytest.raises(PlanConflictError, match=message):
        parse_role(text, "p")

"""Combining sources: each part from the first source that gives it."""

from lightning_5d.plan import PlanSource
from lightning_5d.plan.hints import BlockHints, TopHints, merge

E, P, R, S = (
    PlanSource.EXPLICIT,
    PlanSource.PUBLISHED,
    PlanSource.REGISTRY,
    PlanSource.STRUCTURAL,
)


def test_first_source_wins_per_part():
    merged = merge([(E, TopHints(head="out")), (R, TopHints(embedding="tok", head="lm_head"))])
    assert (merged.hints.embedding, merged.hints.head) == ("tok", "out")
    assert merged.origin == {"head": E, "embedding": R}


def test_a_module_placed_by_a_higher_source_keeps_its_role():
    merged = merge(
        [
            (E, BlockHints(mlp_row=("mlp.up",))),
            (S, BlockHints(mlp_column=("mlp.gate", "mlp.up"), mlp_row=("mlp.down",))),
        ]
    )
    assert merged.hints.mlp_column == ("mlp.gate",)
    assert merged.hints.mlp_row == ("mlp.up",)


def test_fused_and_separate_qkv_are_not_mixed():
    explicit_fused = merge([(E, BlockHints(qkv="att.w")), (S, BlockHints(q="att.q", k="att.k", v="att.v"))])
    assert explicit_fused.hints.qkv == "att.w"
    assert explicit_fused.hints.q is None and "q" not in explicit_fused.origin
    explicit_separate = merge([(E, BlockHints(q="att.q", k="att.k", v="att.v")), (R, BlockHints(qkv="att.w"))])
    assert explicit_separate.hints.qkv is None and explicit_separate.hints.q == "att.q"


def test_head_counts_merge_field_by_field():
    merged = merge([(E, BlockHints(num_heads=8)), (P, BlockHints(num_heads=8, num_kv_heads=2))])
    assert (merged.hints.num_heads, merged.hints.num_kv_heads) == (8, 2)
    assert merged.origin["num_kv_heads"] is P

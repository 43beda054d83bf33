"""The last source: find the parts from the module tree, layer kinds and common names.

Used for models no other source knows. It takes what the earlier sources already
settled (``given``) as context, e.g. it searches for projections only inside an
attention module the user named.
"""

from __future__ import annotations

from torch import nn

from lightning_5d.plan import kinds, moe_parts, paths
from lightning_5d.plan.blocks import find_blocks
from lightning_5d.plan.heads import declared
from lightning_5d.plan.hints import BlockHints, TopHints
from lightning_5d.plan.model_plan import ProjectionKind

# Leaf names (lower case) of the layers in common code bases.
Q_NAMES = frozenset(
    {
        "q_proj",
        "q",
        "query",
        "wq",
        "q_lin",
        "to_q",
        "query_proj",
        "q_linear",
        "linear_q",
    }
)
K_NAMES = frozenset({"k_proj", "k", "key", "wk", "k_lin", "to_k", "key_proj", "k_linear", "linear_k"})
V_NAMES = frozenset(
    {
        "v_proj",
        "v",
        "value",
        "wv",
        "v_lin",
        "to_v",
        "value_proj",
        "v_linear",
        "linear_v",
    }
)
QKV_NAMES = frozenset(
    {
        "qkv_proj",
        "qkv",
        "c_attn",
        "wqkv",
        "query_key_value",
        "to_qkv",
        "in_proj",
        "qkv_linear",
    }
)
# Searched for only inside the attention module: c_proj and wo also name MLP layers.
O_NAMES = frozenset({"o_proj", "out_proj", "wo", "o", "dense", "c_proj", "out", "proj", "to_out", "out_lin", "o_linear", "linear_out", "output"})  # fmt: skip
COLUMN_NAMES = frozenset({"up_proj", "gate_proj", "gate_up_proj", "fc1", "c_fc", "w1", "w3", "fc_in", "dense_h_to_4h", "wi", "wi_0", "wi_1", "up", "gate", "lin1"})  # fmt: skip
ROW_NAMES = frozenset({"down_proj", "fc2", "c_proj", "w2", "fc_out", "dense_4h_to_h", "wo", "down", "lin2"})  # fmt: skip
TOKEN_EMBEDDING_NAMES = frozenset({"embed_tokens", "wte", "tok_embeddings", "word_embeddings", "embed", "embedding", "embeddings", "tok_emb", "token_embedding"})  # fmt: skip
POSITION_WORDS = ("pos", "wpe")


# ---------------------------------------------------------------- model level


def top(root: nn.Module, given: TopHints) -> TopHints:
    modules = dict(root.named_modules())
    blocks = given.blocks if given.blocks is not None else (find_blocks(root)[0] or None)
    outside = {p: m for p, m in modules.items() if p and not (blocks and paths.is_within(p, blocks))}
    embedding = given.embedding or _token_embedding(outside)
    token = modules.get(embedding) if embedding else None
    return TopHints(
        embedding=embedding,
        position_embedding=_position_embedding(outside, embedding, token),
        blocks=blocks,
        final_norm=_final_norm(modules, outside, blocks),
        head=_head(outside, token),
    )


def _token_embedding(outside: dict[str, nn.Module]) -> str | None:
    candidates = [p for p, m in outside.items() if kinds.is_embedding(m) and not _is_position(p)]
    # A projection sharing an embedding's weight (a tied head) marks the token embedding.
    weights = {id(m.weight) for m in outside.values() if kinds.is_projection(m)}
    tied = [p for p in candidates if id(outside[p].weight) in weights]
    named = [p for p in candidates if paths.leaf(p).lower() in TOKEN_EMBEDDING_NAMES]
    for choice in (tied, named, candidates):
        if choice:
            return choice[0]
    return None


def _is_position(path: str) -> bool:
    name = paths.leaf(path).lower()
    return any(word in name for word in POSITION_WORDS)


def _position_embedding(outside: dict[str, nn.Module], embedding: str | None, token: nn.Module | None) -> str | None:
    for path, module in outside.items():
        if path == embedding or not kinds.is_embedding(module) or not _is_position(path):
            continue
        if token is None or module.embedding_dim == token.embedding_dim:
            return path
    return None


def _final_norm(modules: dict[str, nn.Module], outside: dict[str, nn.Module], blocks: str | None) -> str | None:
    """The last norm registered after the blocks (one before them normalizes embeddings)."""
    order = {p: i for i, p in enumerate(modules)}
    after = order.get(blocks, -1) if blocks else -1
    norms = [p for p in outside if kinds.is_norm(outside[p]) and order[p] > after]
    return norms[-1] if norms else None


def _head(outside: dict[str, nn.Module], token: nn.Module | None) -> str | None:
    if not isinstance(token, nn.Embedding):
        return None
    heads = [
        p
        for p, m in outside.items()
        if kinds.is_projection(m)
        and kinds.out_features(m) == token.num_embeddings
        and kinds.in_features(m) == token.embedding_dim
    ]
    tied = [p for p in heads if outside[p].weight is token.weight]
    return (tied or heads or [None])[-1]


# ---------------------------------------------------------------- block level


def block(root: nn.Module, block_path: str, given: BlockHints, hidden: int | None) -> BlockHints:
    """Parts of the block at ``block_path`` (paths relative to it)."""
    module = root.get_submodule(block_path)
    layers = {p: m for p, m in module.named_modules() if p and kinds.is_projection(m)}
    found = BlockHints()
    _find_moe(module, given, found)
    outside_moe = {p: m for p, m in layers.items() if not _inside(p, found.moe or given.moe)}
    _find_attention(outside_moe, given, found)
    _find_mlp(outside_moe, given, found, hidden)
    found.norms = _norms(module, given, found)
    attention = given.attention if given.attention is not None else found.attention
    if attention is not None:
        counts = declared(root, paths.join(block_path, attention))
        found.num_heads, found.num_kv_heads, found.head_dim = (
            counts.num_heads,
            counts.num_kv_heads,
            counts.head_dim,
        )
    return found


def _inside(path: str, container: str | None) -> bool:
    return bool(container) and paths.is_within(path, container)


def _find_moe(module: nn.Module, given: BlockHints, found: BlockHints) -> None:
    """A router that scores the experts, beside the experts: a list of expert MLPs, or
    one module holding their stacked weights (see :mod:`lightning_5d.plan.moe_parts`)."""
    named = dict(module.named_modules())
    for path, experts in named.items():
        if not path or (given.experts is not None and path != given.experts):
            continue
        count = moe_parts.expert_count(experts)
        if given.experts is None and not _unnamed_experts(path, experts, count):
            continue
        moe = paths.parent(path)
        container = named[moe]
        router = given.router or moe_parts.router_beside(
            container, moe, path, count, trust_names=given.experts is not None
        )
        if router is None:
            continue
        found.moe, found.router, found.experts = moe, router, path
        found.shared_experts, found.shared_expert_gate = moe_parts.shared_beside(container, moe, {path, router})
        return


def _unnamed_experts(path: str, experts: nn.Module, count: int | None) -> bool:
    """Experts the plan did not name: a list of two or more, or a grouped module that says so."""
    if count is None or count < 2:
        return False
    return isinstance(experts, nn.ModuleList) or moe_parts.looks_grouped(path, experts)


def _find_attention(layers: dict[str, nn.Module], given: BlockHints, found: BlockHints) -> None:
    if given.attention is not None:
        layers = {p: m for p, m in layers.items() if paths.is_within(p, given.attention)}

    def named(table: frozenset[str]) -> list[str]:
        return [p for p in layers if paths.leaf(p).lower() in table]

    q, k, v, qkv = named(Q_NAMES), named(K_NAMES), named(V_NAMES), named(QKV_NAMES)
    if q and k and v:
        found.q, found.k, found.v = q[0], k[0], v[0]
        anchor = q[0]
    elif qkv:
        found.qkv = anchor = qkv[0]
    else:
        packed = [p for p, m in layers.items() if kinds.projection_kind(m) is ProjectionKind.PACKED_IN_PROJ]
        if packed:  # nn.MultiheadAttention: the module is the attention and its fused in-projection
            found.qkv = found.attention = packed[0]
            found.o = paths.join(packed[0], "out_proj")
        return
    found.attention = paths.parent(anchor) if given.attention is None else given.attention
    found.o = _output_projection(layers, anchor)


def _output_projection(layers: dict[str, nn.Module], anchor: str) -> str | None:
    """The o-named layer nearest the q projection: in its module, else in an enclosing one."""
    scope = paths.parent(anchor)
    while True:
        hits = [p for p in layers if paths.is_within(p, scope) and paths.leaf(p).lower() in O_NAMES]
        if hits:
            return hits[0]
        if not scope:
            return None
        scope = paths.parent(scope)


def _find_mlp(
    layers: dict[str, nn.Module],
    given: BlockHints,
    found: BlockHints,
    hidden: int | None,
) -> None:
    attention = given.attention if given.attention is not None else found.attention
    taken = {found.q, found.k, found.v, found.qkv, found.o, given.o, given.q, given.qkv}
    rest = {p: m for p, m in layers.items() if p not in taken and not (attention and paths.is_within(p, attention))}
    if given.mlp is not None:
        rest = {p: m for p, m in rest.items() if paths.is_within(p, given.mlp)}
    column = [p for p in rest if paths.leaf(p).lower() in COLUMN_NAMES - ROW_NAMES]
    row = [p for p in rest if paths.leaf(p).lower() in ROW_NAMES - COLUMN_NAMES]
    if not (column and row) and hidden is not None:
        # Unfamiliar names: an MLP widens from the hidden size and narrows back to it.
        # Once the attention is known; or, in a block without one (the feed-forward entry of a
        # list alternating attention and MLP entries), only the plain shape of an MLP - one or
        # two widening layers whose width the one narrowing layer takes - lest a fused qkv and
        # its output projection be read as one.
        widening = [p for p, m in rest.items() if _widens(m, hidden)]
        narrowing = [p for p, m in rest.items() if _narrows(m, hidden)]
        if attention is not None or _plain_mlp([rest[p] for p in widening], [rest[p] for p in narrowing]):
            column, row = widening, narrowing
    if column and row:
        found.mlp_column, found.mlp_row = tuple(column), tuple(row)
        found.mlp = paths.common_parent(column + row)


def _plain_mlp(column: list[nn.Module], row: list[nn.Module]) -> bool:
    if not 1 <= len(column) <= 2 or len(row) != 1:
        return False
    return all(kinds.out_features(c) == kinds.in_features(row[0]) for c in column)


def _widens(m: nn.Module, hidden: int) -> bool:
    return kinds.in_features(m) == hidden and kinds.out_features(m) != hidden


def _narrows(m: nn.Module, hidden: int) -> bool:
    return kinds.out_features(m) == hidden and kinds.in_features(m) != hidden


def _norms(module: nn.Module, given: BlockHints, found: BlockHints) -> tuple[str, ...]:
    """Norm layers of the block outside its attention, MLP and MoE (not nested in another norm)."""
    containers = [
        c
        for c in (
            given.attention if given.attention is not None else found.attention,
            given.mlp if given.mlp is not None else found.mlp,
            given.moe if given.moe is not None else found.moe,
        )
        if c
    ]
    norms: list[str] = []
    for path, m in module.named_modules():
        if not path or not kinds.is_norm(m):
            continue
        if any(paths.is_within(path, c) for c in containers + norms):
            continue
        norms.append(path)
    return tuple(norms)

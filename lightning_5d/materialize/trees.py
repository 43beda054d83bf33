"""``leaves`` / ``map_leaves``: torch's pytree flatten and map, without garbage for the cycle collector.

``torch.utils._pytree.tree_flatten`` (and ``tree_map``, built on it) defines a recursive inner
function on every call; the function and its closure cell refer to each other, so each call
leaves a reference cycle that only the cycle collector frees. The meta build flattens the
arguments of every recorded torch call and of every replayed one (thousands of calls for the
0.5 B reference model); the survivors of the young collections sat in the old generation at
``on_train_start`` (~0.2 MiB per rank, benchmarks/RESULTS.md "gap2"). These walk the same pytree
registry with module-level recursion, so their temporaries go as soon as the call returns.
"""

from __future__ import annotations

from typing import Any, Callable

from torch.utils._pytree import SUPPORTED_NODES, _get_node_type, tree_is_leaf, tree_leaves


def leaves(tree: Any) -> list[Any]:
    """The leaves of ``tree`` in ``tree_flatten``'s order."""
    return tree_leaves(tree)  # a recursive generator: no closure, no cycle


def map_leaves(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree_map(fn, tree)``: ``tree`` rebuilt with ``fn`` applied to each leaf."""
    if tree_is_leaf(tree):
        return fn(tree)
    node = SUPPORTED_NODES[_get_node_type(tree)]
    children, context = node.flatten_fn(tree)
    return node.unflatten_fn([map_leaves(fn, child) for child in children], context)

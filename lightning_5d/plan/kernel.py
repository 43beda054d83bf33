"""Which attention kernel a module runs, read from its source code.

Context parallelism replaces this kernel, so it must know whether the module calls
``scaled_dot_product_attention`` (swappable as a function) or spells out the softmax.
The source is parsed, not searched as text, so comments and strings do not count.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import Any

from torch import nn

from lightning_5d.plan.model_plan import AttentionKernel

# Names through which Hugging Face models pick their kernel from
# ``config._attn_implementation`` at run time.
_HF_DISPATCH = frozenset({"ALL_ATTENTION_FUNCTIONS", "attention_interface"})
_HF_IMPLEMENTATIONS = {
    "sdpa": AttentionKernel.SDPA,
    "eager": AttentionKernel.EXPLICIT_SOFTMAX,
}


def detect(attention: nn.Module) -> AttentionKernel:
    if isinstance(attention, nn.MultiheadAttention):
        # Its forward from its parts (lightning_5d.mha_parts, which cp installs) calls
        # F.scaled_dot_product_attention when need_weights=False (as nn.TransformerEncoderLayer asks);
        # need_weights=True spells out the softmax to return the weights, and cp refuses it at the call.
        return AttentionKernel.SDPA
    cls = type(attention)
    # The forward first; then the whole class, for kernels in helper methods.
    for code in (getattr(cls, "forward", None), cls):
        kernel = _kernel_in(_identifiers(code), attention)
        if kernel is not AttentionKernel.UNKNOWN:
            return kernel
    return AttentionKernel.UNKNOWN


def _kernel_in(names: frozenset[str], attention: nn.Module) -> AttentionKernel:
    if "scaled_dot_product_attention" in names:
        return AttentionKernel.SDPA
    if names & _HF_DISPATCH:
        config = vars(attention).get("config")
        implementation = getattr(config, "_attn_implementation", None)
        return _HF_IMPLEMENTATIONS.get(implementation, AttentionKernel.UNKNOWN)
    if "softmax" in names:
        return AttentionKernel.EXPLICIT_SOFTMAX
    return AttentionKernel.UNKNOWN


@functools.lru_cache(maxsize=256)  # every block of a model has the same attention class
def _identifiers(code: Any) -> frozenset[str]:
    """Every name and attribute name used in ``code``'s source; empty if it has none."""
    if code is None:
        return frozenset()
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(code)))
    except (OSError, TypeError, SyntaxError):  # built-ins, REPL classes, odd sources
        return frozenset()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
    return frozenset(names)

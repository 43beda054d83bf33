"""Tensor parallelism of ``nn.MultiheadAttention``: a rank's heads of its packed in-projection.

``nn.MultiheadAttention`` holds q, k and v in one ``in_proj_weight`` ``[3E, E]`` (``[W_q|W_k|W_v]``
stacked on the rows). Here, as in Megatron-LM's attention, rank ``r`` of ``t`` keeps

    in_proj_weight  [q_r | k_r | v_r]   the rows of its H/t heads in each of the three segments  (column)
    in_proj_bias    [q_r | k_r | v_r]   the same entries of the bias
    bias_k, bias_v  [1, 1, E/t]         the entries of its heads (``add_bias_kv``)
    out_proj.weight [E, E/t]            the columns of its heads                                  (row)

and the module runs the forward built from its parts (:mod:`lightning_5d.mha_parts`, the same one
FP8 and cp use) with ``num_heads = H/t`` and ``embed_dim = E/t``: ``softmax(Q_r K_r^T / sqrt(d) + M)
V_r`` for its heads, a per-head mask's slices of those heads, then ``out_proj`` as a module, which
tensor parallelism gives a row-parallel forward (partial product, then g = all-reduce, or g* =
reduce-scatter under sequence parallelism, then the bias once). The parameters keep their names and
classes, so checkpoints and per-shard loading see the module as before. The input side (f / f*) is
:func:`map_qkv_inputs`.

Everything the module takes runs (masks, ``is_causal``, ``add_zero_attn``, ``add_bias_kv``, dropout,
batched or not, ``batch_first`` either way) except ``need_weights=True``, whose weights averaged over
heads need every head: refused at the call, naming the fix.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import Tensor, nn

from lightning_5d.config import LayoutError
from lightning_5d.mha_parts import own_forward

_QKV = ("query", "key", "value")


class PackedAttentionError(LayoutError):
    """An ``nn.MultiheadAttention`` call tensor parallelism cannot split by heads."""


def run_local_heads(module: nn.MultiheadAttention, rank: int, tp: int) -> None:
    """Make ``module`` (parameters already cut) compute this rank's ``H/t`` heads; returns nothing, as
    torch's forward with ``need_weights=False`` returns ``(output, None)`` and out_proj sums over tp."""
    parts = own_forward(module)  # before num_heads changes: the parts keep the full head count
    full_heads = parts.heads
    module.num_heads = full_heads // tp
    module.embed_dim = module.embed_dim // tp
    parts.first_head = rank * module.num_heads
    parts.weights_refused["tp"] = (
        f"nn.MultiheadAttention under tp={tp} was called with need_weights=True (its default): the attention "
        f"weights averaged over heads need every head, and each tp rank holds {module.num_heads} of {full_heads}. "
        f"Pass need_weights=False where the model calls it (nn.TransformerEncoderLayer does), or use tp=1."
    )


def map_qkv_inputs(args: tuple, kwargs: dict, fn: Callable[[Tensor], Tensor], shared_only: bool, where: str):
    """Apply f (or f*) to query, key and value, once per distinct tensor: self-attention passes the
    same tensor three times, and q, k and v must share its one collective (and its gradient sum).

    ``shared_only`` (sequence parallelism): a key/value that is not the query is refused, since
    whether it is a sequence shard (gather it) or a full tensor (leave it) cannot be told here."""
    args = list(args)
    kwargs = dict(kwargs)

    def get(i: int) -> Any:
        return args[i] if i < len(args) else kwargs.get(_QKV[i])

    def put(i: int, value: Tensor) -> None:
        if i < len(args):
            args[i] = value
        else:
            kwargs[_QKV[i]] = value

    done: dict[int, Tensor] = {}
    query = get(0)
    for i in range(3):
        t = get(i)
        if not isinstance(t, Tensor):
            continue
        if id(t) not in done:
            if shared_only and t is not query:
                raise PackedAttentionError(
                    f"sequence parallelism cannot tell whether the {_QKV[i]} passed to {where} "
                    f"(nn.MultiheadAttention) is a sequence shard: it is not the query tensor (cross-attention). "
                    f"Use sequence_parallel=false for this model, or tp=1."
                )
            done[id(t)] = fn(t)
        put(i, done[id(t)])
    return tuple(args), kwargs

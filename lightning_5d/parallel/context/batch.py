"""Cutting a batch along the sequence for context parallelism.

Every tensor shaped ``[b, S, ...]`` (input ids, labels, position ids, masks) is cut along
dim 1 the same way: zig-zag (``2·cp`` chunks, rank ``r`` holds chunks ``r`` and
``2·cp−1−r``) or contiguous. The rank also learns the global positions of its tokens,
which the model's position embedding must see (``positions``).

Labels must arrive aligned with the inputs: a ``training_step`` that shifts
``input_ids[:, 1:]`` inside its shard would drop the boundary token of every chunk and
train on pairs that straddle two chunks. A batch that holds one sequence tensor and no
labels is refused with that explanation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_5d.config import LayoutError, SequenceSharding
from lightning_5d.parallel.context.ring import contiguous_shard, zigzag_shard
from lightning_5d.parallel.token_mean import LABEL_KEYS

IGNORE_INDEX = -100
_NOT_LABELS = ("input_ids", "attention_mask", "position_ids", "token_type_ids", "inputs_embeds")


class ContextParallelError(LayoutError):
    """A batch, model or call that context parallelism cannot handle; the message says what to change."""


@dataclass
class SequenceShard:
    """One rank's part of the current step's batch."""

    batch: Any
    seq_len: int  # global sequence length S
    positions: Tensor  # [S/cp] global positions of this rank's tokens
    labels: Tensor | None  # this rank's labels, to weight metrics by the tokens they cover

    @property
    def local_len(self) -> int:
        return self.positions.numel()

    def token_weight(self) -> Tensor:
        """How many tokens this rank's share of a per-token mean covers (labels != -100)."""
        if self.labels is None or self.labels.is_floating_point():
            return torch.tensor(float(self.local_len), device=self.positions.device)
        return (self.labels != IGNORE_INDEX).sum().to(torch.float64)


def shard_divisor(cp: int, sharding: SequenceSharding) -> int:
    return 2 * cp if sharding is SequenceSharding.ZIGZAG else cp


def check_sequence_length(seq_len: int, cp: int, sharding: SequenceSharding) -> None:
    """Raise if ``seq_len`` cannot be cut into this layout's chunks (usable before any process starts)."""
    parts = shard_divisor(cp, sharding)
    if seq_len % parts == 0:
        return
    lower, upper = seq_len - seq_len % parts, seq_len + parts - seq_len % parts
    examples = f"{lower} or {upper}" if lower else f"{upper}"
    valid_cp = [c for c in range(1, seq_len + 1) if seq_len % shard_divisor(c, sharding) == 0 and c <= 8]
    raise ContextParallelError(
        f"sequence length {seq_len} is not divisible by {'2*cp' if parts != cp else 'cp'}={parts} "
        f"({sharding.value} sharding cuts every sequence into {parts} chunks); pad or crop sequences to a "
        f"multiple of {parts} (e.g. {examples}), or use cp in {valid_cp}."
    )


def shard_batch(batch: Any, rank: int, cp: int, sharding: SequenceSharding) -> SequenceShard:
    """This rank's sequence shard of ``batch`` (a tensor, a mapping, or a tuple/list of tensors)."""
    seq_len, reference, labels = _sequence_of(batch, cp)
    check_sequence_length(seq_len, cp, sharding)
    shard = zigzag_shard if sharding is SequenceSharding.ZIGZAG else contiguous_shard

    def cut(t: Tensor) -> Tensor:
        if t.dim() >= 2 and t.size(0) == reference.size(0) and t.size(1) == seq_len:
            return shard(t, 1, rank, cp)
        return t

    positions = shard(torch.arange(seq_len, device=reference.device), 0, rank, cp)
    return SequenceShard(
        batch=apply_to_collection(batch, Tensor, cut),
        seq_len=seq_len,
        positions=positions,
        labels=cut(labels) if labels is not None else None,
    )


def _sequence_of(batch: Any, cp: int) -> tuple[int, Tensor, Tensor | None]:
    """(global sequence length, the tensor that defines it, the labels tensor or None)."""
    if isinstance(batch, Tensor):
        _require_sequence(batch, "the batch")
        _refuse_unlabelled(cp, "a single tensor")
    if isinstance(batch, Mapping):
        tensors = {k: v for k, v in batch.items() if isinstance(v, Tensor)}
        reference = tensors.get("input_ids")
        if reference is None:
            reference = next((v for v in tensors.values() if v.dim() >= 2), None)
        if reference is None:
            raise ContextParallelError(
                f"cp={cp} cuts sequences, but the batch (keys {sorted(batch)}) holds no [batch, sequence] tensor."
            )
        labels = next((tensors[k] for k in LABEL_KEYS if k in tensors), None)
        if labels is not None and not _same_sequence(labels, reference):
            raise ContextParallelError(
                f"cp={cp} cuts sequences, but the batch's labels have shape {tuple(labels.shape)}, not [batch, "
                f"sequence] = {tuple(reference.shape[:2])}: a per-sequence target (classification) would be trained "
                f"from each rank's shard alone. Use cp=1 for such models."
            )
        _refuse_packed(tensors.get("position_ids"), cp)
        if labels is None:
            others = [k for k, v in tensors.items() if k not in _NOT_LABELS and _same_sequence(v, reference)]
            if not others:
                _refuse_unlabelled(cp, f"keys {sorted(batch)}")
        return reference.size(1), reference, labels
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        tensors = [t for t in batch if isinstance(t, Tensor)]
        if not tensors:
            raise ContextParallelError(f"cp={cp} cuts sequences, but the batch holds no tensor.")
        reference = tensors[0]
        _require_sequence(reference, "the batch's first tensor")
        rest = [t for t in tensors[1:] if _same_sequence(t, reference)]
        if not rest:
            _refuse_unlabelled(cp, "a single sequence tensor")
        return reference.size(1), reference, rest[0]
    raise ContextParallelError(
        f"cp={cp} cannot cut a batch of type {type(batch).__name__} along the sequence; yield a dict "
        f"{{'input_ids': [b, S], 'labels': [b, S]}} (or a tuple of such tensors)."
    )


def _refuse_packed(position_ids: Tensor | None, cp: int) -> None:
    """Per-document position resets ask for document masking, which ring attention does not do."""
    if position_ids is None:
        return
    expected = torch.arange(position_ids.size(-1), device=position_ids.device)
    if not bool((position_ids == expected).all()):
        raise ContextParallelError(
            f"the batch's position_ids are not 0..S-1 in every row (packed documents?); under cp={cp} ring "
            f"attention is causal over the whole sequence and cannot mask between documents. Use cp=1 for packed "
            f"data, or drop position_ids to attend across documents."
        )


def _require_sequence(t: Tensor, what: str) -> None:
    if t.dim() < 2:
        raise ContextParallelError(
            f"{what} has shape {tuple(t.shape)}; context parallelism needs [batch, sequence, ...]."
        )


def _same_sequence(t: Tensor, reference: Tensor) -> bool:
    return t.dim() >= 2 and t.shape[:2] == reference.shape[:2]


def _refuse_unlabelled(cp: int, what: str) -> None:
    raise ContextParallelError(
        f"cp={cp} cuts each sequence into shards, and the batch ({what}) carries no labels: a training_step "
        f"that shifts input_ids[:, 1:] into labels inside a shard loses the boundary token of every chunk. "
        f"Make the data yield labels aligned with input_ids (labels[t] = input_ids[t+1], -100 where there is "
        f"none), e.g. {{'input_ids': ..., 'labels': ...}} as lightning_5d.models.TextDataModule does, and use "
        f"batch['labels'] in training_step."
    )

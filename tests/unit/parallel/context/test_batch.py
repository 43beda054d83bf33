"""Cutting batches along the sequence for context parallelism (one process, no group needed)."""

import pytest
import torch

from lightning_5d.config import SequenceSharding
from lightning_5d.parallel.context.batch import ContextParallelError, check_sequence_length, shard_batch
from lightning_5d.parallel.context.ring import zigzag_unshard

ZIGZAG, CONTIGUOUS = SequenceSharding.ZIGZAG, SequenceSharding.CONTIGUOUS


def batch(b=2, s=16):
    ids = torch.arange(b * s).view(b, s)
    return {"input_ids": ids, "labels": ids + 1000, "attention_mask": torch.ones(b, s, dtype=torch.long),
            "doc_id": torch.tensor([7, 9])}  # fmt: skip


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_shards_reassemble_and_positions_follow_tokens(cp):
    full = batch()
    shards = [shard_batch(full, r, cp, ZIGZAG) for r in range(cp)]
    for key in ("input_ids", "labels", "attention_mask"):
        assert torch.equal(zigzag_unshard([s.batch[key] for s in shards], 1), full[key])
    for s in shards:
        assert torch.equal(s.batch["doc_id"], full["doc_id"])  # not a sequence tensor: untouched
        assert s.seq_len == 16 and s.local_len == 16 // cp
        # the k-th local token of row 0 is token positions[k] of the whole sequence
        assert torch.equal(full["input_ids"][0, s.positions], s.batch["input_ids"][0])
    assert torch.equal(torch.sort(torch.cat([s.positions for s in shards])).values, torch.arange(16))


def test_zigzag_rank_holds_chunk_r_and_its_mirror():
    shard = shard_batch(batch(s=8), 0, 2, ZIGZAG)  # chunks of 2: rank 0 holds 0 and 3
    assert shard.positions.tolist() == [0, 1, 6, 7]
    assert shard_batch(batch(s=8), 1, 2, ZIGZAG).positions.tolist() == [2, 3, 4, 5]
    assert shard_batch(batch(s=8), 1, 2, CONTIGUOUS).positions.tolist() == [4, 5, 6, 7]


def test_tuple_batches_are_cut_too():
    ids = torch.arange(32).view(2, 16)
    shard = shard_batch((ids, ids + 1), 1, 2, CONTIGUOUS)
    assert torch.equal(shard.batch[0], ids[:, 8:]) and torch.equal(shard.batch[1], ids[:, 8:] + 1)
    assert torch.equal(shard.labels, ids[:, 8:] + 1)


def test_token_weight_counts_labels_that_are_not_ignored():
    full = batch(s=8)
    full["labels"][:, :6] = -100  # all ignored tokens fall on zig-zag rank 0 ... and rank 1's first chunk
    weights = [shard_batch(full, r, 2, ZIGZAG).token_weight().item() for r in range(2)]
    assert weights == [4.0, 0.0]


@pytest.mark.parametrize(
    "bad, needle",
    [
        (torch.zeros(2, 16, dtype=torch.long), "carries no labels"),
        ({"input_ids": torch.zeros(2, 16, dtype=torch.long)}, "keys ['input_ids']"),
        ({"input_ids": torch.zeros(2, 16), "attention_mask": torch.ones(2, 16)}, "carries no labels"),
        ((torch.zeros(2, 16),), "a single sequence tensor"),
        ({"x": torch.zeros(3)}, "holds no [batch, sequence] tensor"),
        ("text", "cannot cut a batch of type str"),
        ({"input_ids": torch.zeros(2, 16, dtype=torch.long), "labels": torch.zeros(2)}, "not [batch, sequence]"),
        (
            {"input_ids": torch.zeros(1, 4), "labels": torch.zeros(1, 4), "position_ids": torch.tensor([[0, 1, 0, 1]])},
            "packed documents",
        ),
    ],
)
def test_batches_cp_cannot_cut_correctly_are_refused(bad, needle):
    with pytest.raises(ContextParallelError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        shard_batch(bad, 0, 2, ZIGZAG)


def test_sequence_length_must_divide_into_chunks():
    check_sequence_length(16, 4, ZIGZAG)
    check_sequence_length(12, 4, CONTIGUOUS)
    with pytest.raises(ContextParallelError, match=r"12 is not divisible by 2\*cp=8 .* multiple of 8 \(e.g. 8 or 16\)"):
        check_sequence_length(12, 4, ZIGZAG)
    with pytest.raises(ContextParallelError, match=r"not divisible by cp=4"):
        check_sequence_length(10, 4, CONTIGUOUS)

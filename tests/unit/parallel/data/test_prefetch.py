"""ZeRO-3's prefetch (parallel/data/fsdp.py), on a world of one rank."""

from torch.distributed.fsdp import fully_shard


def test_cpu_units_are_not_prefetched(zero3_blocks):
    """gloo blocks the caller: a prefetched gather on CPU overlaps nothing and holds one more block."""
    _, blocks = zero3_blocks
    states = [fully_shard.state(b) for b in blocks]
    assert all(s._states_to_forward_prefetch == [] for s in states)
    assert all(not s._states_to_backward_prefetch for s in states)

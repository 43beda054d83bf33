"""Data parallelism: the batch split over the data ranks, with the playbook's ZeRO stages.

Playbook symbols: Ψ parameters, k bytes of optimizer state per parameter (12 for Adam with
fp32 masters), N_d the sharding degree (here dp_shard·cp, the mesh's ``dp_shard_cp``; cp
ranks average gradients like data ranks). Model state per rank, bf16 mixed precision (``zero``
gives the fp32 figures):

=======  ==========================  ==============================================
ZeRO-0   2Ψ + 2Ψ + kΨ                ``zero.ZeroDataParallel``: bucketed all-reduce
ZeRO-1   2Ψ + 2Ψ + kΨ/N_d            ``zero``: reduce-scatter, step a slice, all-gather
ZeRO-2   2Ψ + (2Ψ + kΨ)/N_d          ``zero``: gradients released after their reduce
ZeRO-3   (2Ψ + 2Ψ + kΨ)/N_d          ``fsdp.apply_fsdp``: FSDP2 ``fully_shard`` per block
=======  ==========================  ==============================================

``zero_set.ZeroSet`` drives several engines as one (dense and expert parameters reduce over
different groups); ``master_weights`` holds fp32 masters where no engine does.
"""

from lightning_5d.parallel.data.fsdp import apply_fsdp
from lightning_5d.parallel.data.zero import DataGroups, ZeroDataParallel, broadcast_module
from lightning_5d.parallel.data.zero_set import ZeroSet

__all__ = ["DataGroups", "ZeroDataParallel", "ZeroSet", "apply_fsdp", "broadcast_module"]

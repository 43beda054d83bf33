"""Rank 1 fails after joining the group; rank 0 waits in a collective that never completes.

The harness must stop rank 0 once rank 1 has failed (as torchrun does), not at the time limit.
"""

import os

import torch.distributed as dist

if __name__ == "__main__":
    dist.init_process_group("gloo")
    print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} (local {os.environ['LOCAL_RANK']})", flush=True)
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 fails on purpose")
    dist.barrier()  # waits for rank 1 forever

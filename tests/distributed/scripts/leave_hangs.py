"""Rank 1 never leaves; rank 0's leave (lightning_5d.testing.leave_process_group) must give up
after its limit with its stacks, not wait for the launch's time limit."""

import time

import torch.distributed as dist

from lightning_5d.testing import leave_process_group

if __name__ == "__main__":
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        time.sleep(3600)
    leave_process_group(limit_s=5.0)

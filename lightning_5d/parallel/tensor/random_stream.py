"""The tensor-parallel ranks of one model replica draw one random stream.

Between the TP regions (and everywhere without sequence parallelism) the residual stream is
replicated over tp: every rank computes the same values and keeps its own copy. A dropout
there (nanoGPT's ``resid_dropout``, GPT-2's ``embd_pdrop``) must draw the same mask on every tp
rank. Seeding gives the ranks the same stream, and the model consumes it alike on each; but a
draw made on some ranks only (a callback sampling examples to log on rank 0, say) moves them
apart, and nothing shows it: every row projection's all-reduce and the vocabulary-parallel loss
sum the ranks' parts, so the losses still agree while each rank trains its copy of the
replicated parameters (the norms) on other activations than its peers'
(tests/distributed/parallel/tensor/test_dropout.py, a rank-0-only draw between steps).

Before each training step the ranks of a tp group take its first rank's generator states: the
CPU generator's (5,056 bytes, Mersenne Twister) and, on a CUDA device, the device's (seed and
offset, 16 bytes). Where nothing drifted this changes no number.

Not covered: a draw on some ranks only inside ``training_step`` before the forward.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist


def _states(device: torch.device) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def _set_states(device: torch.device, states: list[torch.Tensor]) -> None:
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)


class SharedRandomStream:
    """Aligns the generators of a tp group's ranks with its first rank's (:meth:`align`)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group, self.device = group, device  # (the start-up dry run's stand-in groups are never asked)
        self.realigned = 0  # steps at which this rank's stream had drifted

    def align(self, step: int) -> bool:
        """Take the first rank's generator states; True where this rank's had drifted."""
        states = _states(self.device)
        sizes = [s.numel() for s in states]
        mine = torch.cat(states)
        # NCCL broadcasts device tensors only, gloo host tensors.
        wire = self.device if dist.get_backend(self.group) == "nccl" else torch.device("cpu")
        shared = mine.to(wire, copy=True)
        source = dist.get_global_rank(self.group, 0)
        dist.broadcast(shared, src=source, group=self.group)
        shared = shared.cpu()
        if torch.equal(shared, mine):
            return False
        _set_states(self.device, list(shared.split(sizes)))
        if not self.realigned:
            warnings.warn(
                f"rank {dist.get_rank()}: its random stream differed from its tensor-parallel group's first rank "
                f"(rank {source}) before training step {step}: something drew random numbers on some ranks "
                "only since the previous step (a callback sampling on rank 0, say). It now draws that rank's "
                "stream again, so that the dropout masks of the activations tp replicates agree on every rank. "
                "Draw with a torch.Generator of your own there to leave the training stream alone.",
                stacklevel=2,
            )
        self.realigned += 1
        return True

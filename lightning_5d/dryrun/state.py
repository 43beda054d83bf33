"""Bytes of model state one rank holds at start-up, tensor by tensor, from the cut shapes.

For each parameter piece of ``n`` elements a rank holds after tp / ep / pp
(:mod:`lightning_5d.dryrun.holdings`), ZeRO decides the rest, as the runtime lays it out:

* ZeRO-3 (FSDP2, ``parallel/data/fsdp.py``): ``torch.chunk`` of dim 0 over the shard group,
  this rank's chunk of ``s`` elements; fp32 shard, fp32 sharded gradient, AdamW's two fp32
  moments: ``4s + 4s + 8s`` (mixed precision casts per all-gather, nothing kept).
* ZeRO-0..2 (``parallel/data/zero.py``): the flat piece cut into chunks of ``c = ceil(n/N)``,
  this rank's slice ``L = min(c, n - r*c)``. With bf16 (or fp16) parameters (mixed precision
  casts them, ``FiveDPrecision.cast_parameters``): params ``2n``; gradients ``4n`` at ZeRO-0
  (fp32 master gradients), ``2n + 4L`` at ZeRO-1 (``4L`` with fp32 accumulation), ``4L`` at
  ZeRO-2; optimizer ``12L`` (fp32 master + two moments; ``12n`` at ZeRO-0). In fp32: params
  ``4n``, gradients ``4n`` (``4L`` at ZeRO-2), optimizer ``8L`` (``8n`` at ZeRO-0): the
  master slices alias the parameters. A frozen tensor (``requires_grad=False`` as built) holds
  its parameter bytes only: no gradient, no fp32 master, no moments.

The shard group is dp_shard x cp for dense tensors and edp_shard (dp_shard x cp / ep) for
routed experts; ``r`` is this rank's place in it (``RankMesh``). This is the
``StateAccounting.RUNTIME`` model of ``lightning_5d.estimate.memory``, counted per real tensor
(ceil chunks, replicated kv heads, uneven pipeline stages) instead of from Psi.

Materialization (``lightning_5d.materialize.apply``) recomputes one whole unsplit tensor at a
time and cuts this rank's piece from it: the transient is the largest such tensor plus its
tp / ep piece when one is cut (see :func:`materialize_transient`).

The plan verifier (where setup runs it: ``ParallelConfig.checks_plan``) compares each piece the
rank holds with the unparallelized piece, in fp32 on the device: its peak is the rank's
parameters plus the largest unsplit tensor of those pieces in fp32 (its full weight, then its
full gradient once the weight is freed; measured within 27-37 MiB of that on a 0.5 B model,
benchmarks/RESULTS.md "stop 38"). Routed experts are not compared under expert dispatch
(see :func:`check_transient`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_5d.config import Layout, ZeroStage
from lightning_5d.dryrun.holdings import HeldTensor
from lightning_5d.dryrun.rank_mesh import RankMesh


@dataclass(frozen=True)
class StateRules:
    """What decides the bytes besides the shapes."""

    zero: ZeroStage
    low_precision_params: bool  # mixed precision: parameters cast to 2 bytes (ZeRO-0..2)
    fp32_accumulation: bool = False
    plan_check: bool = False  # setup runs the plan verifier (ParallelConfig.checks_plan)


@dataclass(frozen=True)
class RankState:
    """Bytes one rank holds (see the module docstring), and the largest materialization transient."""

    params: int
    grads: int
    optimizer: int
    transient: int
    transient_name: str
    check: int = 0  # the plan verifier's transient, where it runs (check_transient)
    check_name: str = ""

    @property
    def states(self) -> int:
        """At the first optimizer step: parameters, gradients and optimizer states."""
        return self.params + self.grads + self.optimizer

    @property
    def materialize_peak(self) -> int:
        """While materializing, with the device being the host (CPU training): the parameters plus
        the tensor being recomputed (no gradients or optimizer states exist yet)."""
        return self.params + self.transient

    @property
    def check_peak(self) -> int:
        """While the plan verifier compares the largest piece: the parameters plus its full tensor."""
        return self.params + self.check

    def key(self) -> tuple:
        return (self.params, self.grads, self.optimizer, self.transient, self.transient_name, self.check,
                self.check_name)  # fmt: skip


def shard_groups(layout: Layout, mesh: RankMesh) -> tuple[tuple[int, int], tuple[int, int]]:
    """(size, this rank's index) of the dense and the expert shard groups."""
    dense = (mesh.size("dp_shard_cp"), mesh.local_rank("dp_shard_cp"))
    expert = (mesh.size("edp_shard"), mesh.local_rank("edp_shard")) if layout.ep > 1 else dense
    return dense, expert


def chunk_rows(rows: int, size: int, index: int) -> int:
    """Rows ``torch.chunk(rows, size)[index]`` holds (0 past the last chunk), as FSDP2 shards dim 0."""
    c = math.ceil(rows / size)
    return max(0, min(c, rows - index * c))


def flat_slice(n: int, size: int, index: int) -> int:
    """ZeRO-1/2's slice of a flat piece of ``n`` elements (``ZeroDataParallel._make_shard``)."""
    c = math.ceil(n / size)
    return max(0, min(c, n - min(index * c, n)))


def tensor_state(t: HeldTensor, rules: StateRules, group: tuple[int, int]) -> tuple[int, int, int]:
    size, index = group
    w = t.itemsize  # as built: fp32
    n = t.numel
    if rules.zero == ZeroStage.PARAMETERS:
        rows = t.shape[0] if t.shape else 1
        s = chunk_rows(rows, size, index) * (n // rows if rows else 0)
        return (w * s, w * s, 2 * w * s) if t.trainable else (w * s, 0, 0)
    if not t.trainable:  # no gradient, no master, no moments (ZeRO-0..2 leave it whole)
        return (2 if rules.low_precision_params else w) * n, 0, 0
    sliced = n if rules.zero == ZeroStage.NONE else flat_slice(n, size, index)
    if rules.low_precision_params:
        params = 2 * n
        grads = {
            ZeroStage.NONE: w * n,
            ZeroStage.OPTIMIZER: (0 if rules.fp32_accumulation else 2 * n) + w * sliced,
            ZeroStage.GRADIENTS: w * sliced,
        }[rules.zero]
        return params, grads, 3 * w * sliced
    grads = w * sliced if rules.zero == ZeroStage.GRADIENTS else w * n
    return w * n, grads, 2 * w * sliced


def materialize_transient(tensors: tuple[HeldTensor, ...]) -> tuple[int, str]:
    """The largest (bytes, name) that materialization holds besides the rank's own tensors:
    one unsplit tensor recomputed in full, plus its tp / ep piece while that is cut from it."""
    best = (0, "")
    for t in tensors:
        extra = t.full_numel * t.itemsize + (t.numel * t.itemsize if t.cut else 0)
        best = max(best, (extra, t.name))
    return best


def rank_state(tensors: tuple[HeldTensor, ...], rules: StateRules, layout: Layout, rank: int) -> RankState:
    dense, expert = shard_groups(layout, RankMesh(layout, rank))
    params = grads = optimizer = 0
    for t in tensors:
        p, g, o = tensor_state(t, rules, expert if t.expert else dense)
        params, grads, optimizer = params + p, grads + g, optimizer + o
    transient, name = materialize_transient(tensors)
    check, check_name = check_transient(tensors) if rules.plan_check else (0, "")
    return RankState(params, grads, optimizer, transient, name, check, check_name)


def check_transient(tensors: tuple[HeldTensor, ...]) -> tuple[int, str]:
    """The largest (bytes, name) the plan verifier holds besides the rank's own tensors: one
    unsplit tensor in fp32 (the reference piece computes in fp32). Routed experts are left
    out: under expert dispatch the verifier does not compare the MoE (its one-process version
    is not the reference: token dropping, routing bias), and without it an expert's tensors are
    far smaller than the embedding's."""
    best = (0, "")
    for t in tensors:
        if not t.expert:
            best = max(best, (t.full_numel * 4, t.name))
    return best

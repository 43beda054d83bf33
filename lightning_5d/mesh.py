"""One N-D DeviceMesh for the whole job, and the named sub-meshes every consumer asks for.

The mesh is the single source of truth for the layout: nothing else computes ranks or
group membership. Flattened meshes (several dims seen as one) are created once here and
kept, since torch is retiring re-slicing them from the root mesh.

Process groups: ``init_device_mesh`` makes one group per dimension, including a one-rank
group for each dimension of size 1 (four of the five under ZeRO-3 alone: a gloo group has
three threads, an NCCL one a communicator). Here every size-1 dimension shares one
one-rank group, and the expert mesh reuses the root's groups for the dimensions it shares
with it (pp, dp_replicate, tp). torch's ``_flatten`` still makes a group per flattened mesh,
also where its members are those of one dim (or of one rank).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_5d.config import DEFAULT_RANK_ORDER, Layout

# name -> the real dims it spans. Order inside each tuple follows the rank order at runtime.
FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),  # data ranks: the sampler's replicas
    "dp_shard_cp": ("dp_shard", "cp"),  # where parameters / optimizer states are sharded
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),  # where gradients are averaged
}

# The expert mesh re-reads the same ranks with dp_shard x cp cut into (edp_shard, ep):
# expert parallelism borrows ranks that already hold different tokens, as in Megatron
# and torchtitan, so it does not grow the world.
EXPERT_DIMS = ("pp", "dp_replicate", "edp_shard", "ep", "tp")
_CANONICAL = DEFAULT_RANK_ORDER  # the order the expert and context cuts below read the dims in


def _root_mesh(device_type: str, layout: Layout) -> DeviceMesh:
    """The job's mesh over ``layout.rank_order``; its size-1 dims share one one-rank group."""
    names = layout.rank_order
    shape = tuple(getattr(layout, d) for d in names)
    real = [d for d, n in zip(names, shape) if n > 1]
    if len(real) == len(names) or layout.world_size == 1:
        return init_device_mesh(device_type, shape, mesh_dim_names=names)  # no size-1 dim (or only the world's)
    ranks = torch.arange(layout.world_size, dtype=torch.int).reshape(shape)
    groups: dict[str, dist.ProcessGroup] = {}
    if real:
        # torch's own path for the dims with peers (ncclCommSplit where the device is bound).
        compact = DeviceMesh(device_type, ranks.reshape([n for n in shape if n > 1]), mesh_dim_names=tuple(real))
        groups = {d: compact.get_group(d) for d in real}
    one = _one_rank_group()
    return DeviceMesh.from_group([groups.get(d, one) for d in names], device_type, mesh=ranks, mesh_dim_names=names)


def _one_rank_group() -> dist.ProcessGroup:
    """This rank's group of itself."""
    return _line_group([[r] for r in range(dist.get_world_size())])


def _line_group(lines: list[list[int]]) -> dist.ProcessGroup:
    """This rank's group among ``lines`` (disjoint, covering the world), made as torch's DeviceMesh
    makes a dim's groups: one ``split_group`` where the default group's communicator is bound to a
    device (eager NCCL: one split for all lines), else a ``new_group`` per line, every rank calling
    each in the same order (``new_group``'s rule)."""
    default = dist.distributed_c10d._get_default_group()
    if getattr(default, "bound_device_id", None) is not None and torch.accelerator.is_available():
        group = dist.split_group(split_ranks=lines, group_desc="mesh_line")
        assert group is not None  # the lines cover every rank
        return group
    group, _ = dist.new_subgroups_by_enumeration(lines)
    return group


def _enumerated_group(
    ranks: torch.Tensor, dim: int, one_rank_group: Callable[[], dist.ProcessGroup]
) -> dist.ProcessGroup:
    """This rank's group along ``ranks``' dim ``dim``: every line of ranks along it is a group.
    A group orders its members by rank, the mesh by coordinate: the lines must ascend, which
    ``resolve_layout`` ensures for the expert mesh (``Layout.expert_misread``)."""
    size = ranks.shape[dim]
    if size == 1:
        return one_rank_group()
    if size == ranks.numel():
        return dist.group.WORLD
    return _line_group(ranks.movedim(dim, -1).reshape(-1, size).tolist())


class ParallelMesh:
    """Named access to the job's DeviceMesh: ``mesh["tp"]``, ``mesh["dp_shard_cp"]``, ..."""

    def __init__(self, layout: Layout, device_type: str) -> None:
        if dist.is_initialized() and dist.get_world_size() != layout.world_size:
            raise RuntimeError(
                f"layout needs {layout.world_size} ranks ({layout.describe()}) but the process group "
                f"has {dist.get_world_size()}."
            )
        self.layout = layout
        self.root: DeviceMesh = _root_mesh(device_type, layout)
        self._flat: dict[str, DeviceMesh] = {
            name: self._submesh(dims)._flatten(name) for name, dims in FLATTENED.items()
        }
        self.expert_root: DeviceMesh | None = self._expert_mesh() if layout.ep > 1 else None
        if self.expert_root is not None:
            # edp: the ranks that hold the same experts, where expert gradients are reduced.
            self._flat["edp"] = self.expert_root[("dp_replicate", "edp_shard")]._flatten("edp")
            self._flat["ep"] = self.expert_root["ep"]
            self._flat["edp_shard"] = self.expert_root["edp_shard"]

    def _expert_mesh(self) -> DeviceMesh:
        # Its lines ascend (resolve_layout refuses a rank order where they do not: Layout.expert_misread).
        ranks = self.layout.expert_ranks()
        # pp, dp_replicate and tp hold the same ranks as the root's dims of those names.
        groups = [self.root.get_group(d) if d in _CANONICAL else _enumerated_group(ranks, i, self._one_rank_group)
                  for i, d in enumerate(EXPERT_DIMS)]  # fmt: skip
        return DeviceMesh.from_group(groups, self.root.device_type, mesh=ranks, mesh_dim_names=EXPERT_DIMS)

    def _one_rank_group(self) -> dist.ProcessGroup:
        """The root's one-rank group (that of any of its size-1 dims); made now if it has none."""
        lay = self.layout
        ones = [d for d in lay.rank_order if getattr(lay, d) == 1]
        return self.root.get_group(ones[0]) if ones else _one_rank_group()

    def _submesh(self, dims: Sequence[str]) -> DeviceMesh:
        unknown = [d for d in dims if d not in self.layout.rank_order]
        if unknown:
            raise KeyError(f"{unknown} are not dims of the root mesh {self.layout.rank_order}")
        ordered = tuple(d for d in self.layout.rank_order if d in dims)
        return self.root[ordered]

    def __getitem__(self, name: str | tuple[str, ...]) -> DeviceMesh:
        if isinstance(name, tuple):
            return self._submesh(name)
        if name in self._flat:
            return self._flat[name]
        if name in self.layout.rank_order:
            return self.root[name]
        valid = sorted(self.layout.rank_order) + sorted(self._flat)
        hint = " (ep and edp exist only when ep > 1)" if name in ("ep", "edp", "edp_shard") else ""
        raise KeyError(f"no sub-mesh named {name!r}{hint}; valid names: {valid}")

    def size(self, name: str) -> int:
        return self[name].size()

    def local_rank(self, name: str) -> int:
        return self[name].get_local_rank()

    def group(self, name: str) -> dist.ProcessGroup:
        return self[name].get_group()

    def context_groups(self, ulysses: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """This rank's (Ulysses, ring) groups of the hybrid cp mode: cp cut into ``cp/ulysses × ulysses``.

        The Ulysses group is ``ulysses`` consecutive cp ranks (cp rank ``g·ulysses + u`` is in
        group ``g``); the ring group holds the cp ranks with the same ``u``, one per group.
        Every rank creates every group, in the same order (``new_group``'s rule).
        """
        lay = self.layout
        ranks = self.root.mesh.permute([lay.rank_order.index(d) for d in _CANONICAL])  # cp is dim 3
        split = ranks.reshape(-1, lay.cp // ulysses, ulysses, lay.tp).permute(0, 3, 1, 2)  # [rest, tp, R, U]
        rows = split.reshape(-1, lay.cp // ulysses, ulysses)
        uly, _ = dist.new_subgroups_by_enumeration([r.tolist() for g in rows for r in g])
        ring, _ = dist.new_subgroups_by_enumeration([c.tolist() for g in rows for c in g.t()])
        return uly, ring

    def pipe_pair_group(self, first: int, last: int) -> dist.ProcessGroup:
        """This rank's group of two pp ranks ``first`` and ``last`` of its own pipe (tied
        embeddings: the first and the last stage's ranks). Every rank creates every pipe's pair."""
        lay = self.layout
        ranks = self.root.mesh.permute([lay.rank_order.index(d) for d in _CANONICAL])  # pp is dim 0
        pipes = ranks.permute(1, 2, 3, 4, 0).reshape(-1, lay.pp)
        group, _ = dist.new_subgroups_by_enumeration([[int(p[first]), int(p[last])] for p in pipes])
        return group

    def across_tp_group(self) -> dist.ProcessGroup:
        """This rank's group of every rank with its tp index: all pp, data and cp ranks, one of each tp
        group (a metric's updates are the same on a tp group's ranks). Made on first use, on every rank."""
        if "across_tp" not in self._flat:
            self._flat["across_tp"] = self._submesh(("pp", "dp_replicate", "dp_shard", "cp"))._flatten("across_tp")
        return self.group("across_tp")

    @property
    def data_rank(self) -> int:
        """Which shard of the data this rank reads (tp/cp/pp peers read the same one)."""
        return self.local_rank("dp")

    @property
    def data_size(self) -> int:
        return self.size("dp")

    def __repr__(self) -> str:
        return f"ParallelMesh({self.layout.describe()})"

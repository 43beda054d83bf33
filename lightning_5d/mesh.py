"""One N-D DeviceMesh for the whole job, and the named sub-meshes every consumer asks for.

The mesh is the single source of truth for the layout: nothing else computes ranks or
group membership. Flattened meshes (several dims seen as one) are created once here and
kept, since torch is retiring re-slicing them from the root mesh.
"""

from __future__ import annotations

from typing import Sequence

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_5d.config import Layout

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
_CANONICAL = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class ParallelMesh:
    """Named access to the job's DeviceMesh: ``mesh["tp"]``, ``mesh["dp_shard_cp"]``, ..."""

    def __init__(self, layout: Layout, device_type: str) -> None:
        if dist.is_initialized() and dist.get_world_size() != layout.world_size:
            raise RuntimeError(
                f"layout needs {layout.world_size} ranks ({layout.describe()}) but the process group "
                f"has {dist.get_world_size()}."
            )
        self.layout = layout
        self.root: DeviceMesh = init_device_mesh(
            device_type,
            tuple(getattr(layout, d) for d in layout.rank_order),
            mesh_dim_names=layout.rank_order,
        )
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
        lay = self.layout
        ranks = self.root.mesh.permute([lay.rank_order.index(d) for d in _CANONICAL])
        ranks = ranks.reshape(lay.pp, lay.dp_replicate, lay.dp_shard * lay.cp // lay.ep, lay.ep, lay.tp)
        return DeviceMesh(self.root.device_type, ranks, mesh_dim_names=EXPERT_DIMS)

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

    @property
    def data_rank(self) -> int:
        """Which shard of the data this rank reads (tp/cp/pp peers read the same one)."""
        return self.local_rank("dp")

    @property
    def data_size(self) -> int:
        return self.size("dp")

    def __repr__(self) -> str:
        return f"ParallelMesh({self.layout.describe()})"

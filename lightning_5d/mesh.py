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

    def _submesh(self, dims: Sequence[str]) -> DeviceMesh:
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
        raise KeyError(f"no sub-mesh named {name!r}; valid names: {valid}")

    def size(self, name: str) -> int:
        return self[name].size()

    def local_rank(self, name: str) -> int:
        return self[name].get_local_rank()

    def group(self, name: str) -> dist.ProcessGroup:
        return self[name].get_group()

    @property
    def data_rank(self) -> int:
        """Which shard of the data this rank reads (tp/cp/pp peers read the same one)."""
        return self.local_rank("dp")

    @property
    def data_size(self) -> int:
        return self.size("dp")

    def __repr__(self) -> str:
        return f"ParallelMesh({self.layout.describe()})"

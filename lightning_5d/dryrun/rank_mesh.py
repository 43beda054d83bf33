"""``RankMesh``: what :class:`~lightning_5d.mesh.ParallelMesh` tells rank ``r``, from its coordinates alone.

The dry run (``l5d train ... --dry-run``) cuts a meta-device model as rank ``r`` of a job
that never starts, so there is no process group and no ``DeviceMesh``. The dimensions read
only sizes and this rank's position from the mesh while they cut (``size``, ``local_rank``;
their groups are used by collectives at training time, never while cutting), and those
follow from the layout: the root mesh is ``layout.rank_order`` laid out row-major over the
global ranks (``init_device_mesh``), a flattened mesh (``dp``, ``dp_shard_cp``, ``dp_cp``)
is its dims read row-major in the same order, and the expert mesh re-reads ``dp_shard x
cp`` (in that order) as ``edp_shard x ep`` (``mesh.EXPERT_DIMS``). ``group()`` is ``None``:
anything that tries to communicate fails loudly instead of pretending.

tests/unit/dryrun/test_rank_mesh.py checks every name against a real ``ParallelMesh``
built on torch's in-process fake backend, for every rank of several layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_5d.config import Layout
from lightning_5d.mesh import FLATTENED


@dataclass(frozen=True)
class MeshDim:
    """One named (sub-)mesh as rank ``r`` sees it: the part of ``DeviceMesh`` the cuts read."""

    name: str
    _size: int
    _rank: int
    device_type: str = "meta"

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank

    def get_group(self) -> None:
        return None  # no process group: see the module docstring


class RankMesh:
    """``ParallelMesh``'s read-only interface for global rank ``rank`` of ``layout``."""

    def __init__(self, layout: Layout, rank: int, device_type: str = "meta") -> None:
        if not 0 <= rank < layout.world_size:
            raise ValueError(f"rank={rank} is outside the layout's {layout.world_size} ranks ({layout.describe()})")
        self.layout = layout
        self.rank = rank
        self.device_type = device_type
        self.root = MeshDim("root", layout.world_size, rank, device_type)
        self.coords = self._coordinates()
        self._dims: dict[str, MeshDim] = {}
        for d in layout.rank_order:
            self._dims[d] = MeshDim(d, getattr(layout, d), self.coords[d], device_type)
        for name, dims in FLATTENED.items():
            self._dims[name] = self._flat(name, [d for d in layout.rank_order if d in dims])
        if layout.ep > 1:
            # This rank's place on the expert mesh's grid (pp, dp_replicate, edp_shard, ep, tp).
            grid = layout.expert_ranks()
            _, replica, shard, expert, _ = (grid == rank).nonzero()[0].tolist()
            edp_shard_size = grid.shape[2]
            self._dims["ep"] = MeshDim("ep", layout.ep, expert, device_type)
            self._dims["edp_shard"] = MeshDim("edp_shard", edp_shard_size, shard, device_type)
            edp = replica * edp_shard_size + shard
            self._dims["edp"] = MeshDim("edp", layout.dp_replicate * edp_shard_size, edp, device_type)

    def _coordinates(self) -> dict[str, int]:
        coords, rest = {}, self.rank
        for d in reversed(self.layout.rank_order):  # row-major: the last dim varies fastest
            size = getattr(self.layout, d)
            coords[d] = rest % size
            rest //= size
        return coords

    def _flat(self, name: str, dims: list[str]) -> MeshDim:
        size, rank = 1, 0
        for d in dims:
            n = getattr(self.layout, d)
            size, rank = size * n, rank * n + self.coords[d]
        return MeshDim(name, size, rank, self.device_type)

    def __getitem__(self, name: str | tuple[str, ...]) -> MeshDim:
        if isinstance(name, tuple):
            return self._flat("_".join(name), [d for d in self.layout.rank_order if d in name])
        if name not in self._dims:
            raise KeyError(f"no sub-mesh named {name!r}; valid names: {sorted(self._dims)}")
        return self._dims[name]

    def size(self, name: str) -> int:
        return self[name].size()

    def local_rank(self, name: str) -> int:
        return self[name].get_local_rank()

    def group(self, name: str) -> None:
        self[name]  # an unknown name still raises
        return None

    def context_groups(self, ulysses: int) -> tuple[None, None]:
        return None, None

    def __repr__(self) -> str:
        return f"RankMesh(rank {self.rank} of {self.layout.describe()})"

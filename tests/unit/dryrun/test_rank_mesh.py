"""RankMesh (a rank's mesh from its coordinates) against the real ParallelMesh, rank by rank;
and the real mesh's process groups: members, rank order, and no duplicate one-rank groups.

The real mesh is built on torch's in-process ``fake`` backend: every rank of a layout is
initialized in turn in this one process (no communication happens), so each name's size and
local rank can be compared for every rank of several layouts, expert mesh and rank orders included.
"""

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_5d.config import ParallelConfig
from lightning_5d.dryrun.rank_mesh import RankMesh
from lightning_5d.mesh import ParallelMesh

LAYOUTS = [  # (parallel section, world size)
    ({"tp": 2, "pp": 2, "cp": 2, "ep": 2, "dp_shard": "auto"}, 16),
    ({"tp": 2, "dp_replicate": 2, "dp_shard": "auto", "ep": 4}, 16),
    ({"tp": 2, "pp": 2, "dp_shard": "auto", "rank_order": ["tp", "dp_replicate", "dp_shard", "cp", "pp"]}, 8),
    ({"cp": 4, "dp_shard": "auto", "ep": 2}, 8),
]
NAMES = ["pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_shard_cp", "dp_cp"]
EXPERT_NAMES = ["ep", "edp", "edp_shard"]


@pytest.mark.parametrize("section,world", LAYOUTS)
def test_every_rank_sees_what_the_real_mesh_says(section, world):
    layout = ParallelConfig.from_mapping(section).resolve(world)
    names = NAMES + (EXPERT_NAMES if layout.ep > 1 else [])
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            real = ParallelMesh(layout, "cpu")
            expected = {n: (real.size(n), real.local_rank(n)) for n in names}
        finally:
            dist.destroy_process_group()
        view = RankMesh(layout, rank)
        assert {n: (view.size(n), view.local_rank(n)) for n in names} == expected, rank


# (section, world, groups each rank gains): ZeRO-3 alone needs one one-rank group for its four
# size-1 dims (init_device_mesh made four); tp2 x dp_shard2: dp_shard, tp, the one-rank group and
# torch's three flattened meshes (dp, dp_shard_cp, dp_cp: same members as dp_shard; was 8).
GROUP_LAYOUTS = [(*layout, None) for layout in LAYOUTS] + [
    ({"dp_shard": "auto"}, 4, 1), ({"tp": 2, "dp_shard": "auto"}, 4, 6), ({"tp": 4}, 4, None),
    # ep under rank orders that keep dp_replicate, dp_shard, cp in that relative order (others are refused)
    ({"cp": 2, "dp_shard": "auto", "ep": 4, "rank_order": ["tp", "dp_replicate", "pp", "dp_shard", "cp"]}, 4, None),
    ({"dp_replicate": 2, "cp": 2, "dp_shard": "auto", "ep": 2, "rank_order": ["dp_replicate", "tp", "dp_shard", "pp",
                                                                              "cp"]}, 8, None),
]  # fmt: skip


@pytest.mark.parametrize("section,world,groups", GROUP_LAYOUTS)
def test_each_name_has_a_group_of_its_members_in_mesh_order_and_size_1_dims_share_one(section, world, groups):
    layout = ParallelConfig.from_mapping(section).resolve(world)
    names = NAMES + (EXPERT_NAMES if layout.ep > 1 else [])
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            before = len(dist.distributed_c10d._world.pg_map)
            real = ParallelMesh(layout, "cpu")
            made = len(dist.distributed_c10d._world.pg_map) - before
            for n in names:
                group, mesh = real.group(n), real[n]
                # The group's members are the mesh's ranks along n, and a member's rank in the
                # group is its coordinate on the mesh (collectives and DTensor placements agree).
                assert dist.get_process_group_ranks(group) == sorted(mesh.mesh.flatten().tolist()), (n, rank)
                assert dist.get_group_rank(group, rank) == mesh.get_coordinate()[0], (n, rank)
            ones = {id(real.group(n)) for n in layout.rank_order if real.size(n) == 1}
            assert len(ones) <= 1, f"the size-1 dims have {len(ones)} one-rank groups"
            if layout.ep > 1:
                for d in ("pp", "dp_replicate", "tp"):
                    assert real.expert_root.get_group(d) is real.group(d)
        finally:
            dist.destroy_process_group()
        if groups is not None:
            assert made == groups, (rank, made)


def test_a_rank_outside_the_layout_and_an_unknown_name_are_refused():
    layout = ParallelConfig.from_mapping({"tp": 2, "dp_shard": "auto"}).resolve(4)
    with pytest.raises(ValueError, match="rank=4 is outside"):
        RankMesh(layout, 4)
    with pytest.raises(KeyError, match="no sub-mesh named 'ep'"):
        RankMesh(layout, 0)["ep"]
    assert RankMesh(layout, 3).group("tp") is None  # nothing may communicate through it

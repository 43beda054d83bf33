"""The guard of ZeRO-3's in-place gather (parallel/data/gather_in_place.py), on stand-ins for FSDP2's
internals: anything but one dim-0 CPU parameter under FSDP2's default comm, or internals not where
torch 2.13 has them, keeps FSDP2's own gather."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

from lightning_5d.parallel.data.gather_in_place import InPlaceAllGather, eligible, one_param


class FakeParam:
    """What FSDP2's FSDPParam offers the in-place gather (torch 2.13), without a process group."""

    def __init__(self, dim=0, device="cpu", local=None):
        self.all_gather_outputs = []
        self.fsdp_placement = SimpleNamespace(dim=dim)
        self._sharded_local_tensor = torch.zeros(2) if local is None else local
        self.offload_to_cpu = False
        self.device = torch.device(device)

    def init_all_gather_outputs(self, numels, dtypes, world_size, device):
        if not self.all_gather_outputs:
            self.all_gather_outputs = [
                torch.empty(n * world_size, dtype=d, device=device) for n, d in zip(numels, dtypes)
            ]

    def alloc_all_gather_outputs(self):
        for t in self.all_gather_outputs:
            if t.untyped_storage().size() != t.numel() * t.itemsize:
                t.untyped_storage().resize_(t.numel() * t.itemsize)


def groups(*params, comm=None):
    return [SimpleNamespace(_all_gather_comm=comm or DefaultAllGather(), fsdp_params=list(params))]


class WithPreAllGather(torch.Tensor):
    def fsdp_pre_all_gather(self, *args):  # what an FP8 all-gather weight's local tensor has
        raise AssertionError("never called by the guard")


def test_one_dim0_cpu_parameter_is_eligible():
    param = FakeParam()
    assert one_param(groups(param)) is param


@pytest.mark.parametrize(
    "case",
    ["two params", "two groups", "dim 1", "accelerator", "fp8 extension", "custom comm", "offload", "no groups"],
)
def test_everything_else_keeps_fsdp2s_gather(case):
    p = FakeParam()
    found = {
        "two params": groups(p, FakeParam()),
        "two groups": groups(p) + groups(FakeParam()),
        "dim 1": groups(FakeParam(dim=1)),
        "accelerator": groups(FakeParam(device="meta")),
        "fp8 extension": groups(FakeParam(local=torch.zeros(2).as_subclass(WithPreAllGather))),
        "custom comm": groups(p, comm=InPlaceAllGather(p)),
        "offload": groups(SimpleNamespace(**{**vars(p), "offload_to_cpu": True})),
        "no groups": None,
    }[case]
    assert one_param(found) is None


@pytest.mark.parametrize("missing", ["init_all_gather_outputs", "alloc_all_gather_outputs", "all_gather_outputs",
                                     "fsdp_placement", "_sharded_local_tensor"])  # fmt: skip
def test_fsdp2_internals_not_as_expected_keep_its_gather(missing):
    """A torch whose FSDPParam lacks what the in-place gather uses: nothing is installed."""
    fields = {k: v for k, v in vars(FakeParam()).items() if k != missing}
    names = ("init_all_gather_outputs", "alloc_all_gather_outputs")
    methods = {m: getattr(FakeParam(), m) for m in names if m != missing}
    assert one_param(groups(SimpleNamespace(**fields, **methods))) is None


def test_a_module_fsdp2_did_not_shard_is_not_eligible():
    assert eligible(nn.Linear(2, 2)) is None


def test_allocate_hands_back_the_parameters_buffer_with_its_own_version_counter():
    param = FakeParam()
    comm = InPlaceAllGather(param)
    out = comm.allocate((12,), dtype=torch.float32, device=torch.device("cpu"))
    target = param.all_gather_outputs[0]
    assert out.data_ptr() == target.data_ptr() and out.shape == target.shape and comm.in_place == 1
    version = target._version
    out.fill_(1.0)  # the collective's writes
    assert target._version == version and bool((target == 1).all())
    target.untyped_storage().resize_(0)  # reshard frees the storage; the next gather allocates it again
    again = comm.allocate((12,), dtype=torch.float32, device=torch.device("cpu"))
    assert again.data_ptr() == target.data_ptr() and target.untyped_storage().size() == 48


@pytest.mark.parametrize("asked", [((10,), torch.float32), ((12,), torch.bfloat16), ((3, 4), torch.float32)])
def test_allocate_falls_back_to_a_buffer_of_its_own_when_the_parameters_does_not_fit(asked):
    param = FakeParam()
    param.all_gather_outputs = [torch.empty(12)]
    comm = InPlaceAllGather(param)
    size, dtype = asked
    out = comm.allocate(size, dtype=dtype, device=torch.device("cpu"))
    assert tuple(out.shape) == size and out.dtype == dtype and comm.in_place == 0
    assert out.untyped_storage().data_ptr() != param.all_gather_outputs[0].untyped_storage().data_ptr()

"""Fp8AllGatherWeight on one process: the tensor subclass, the FSDP2 hooks called directly,
enable_fp8_all_gather, state dicts, and fully_shard on a 1-rank mesh. The 2-rank runs are
in tests/distributed/fp8/test_fsdp_all_gather.py."""

import copy
import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_5d.fp8.fsdp_all_gather import Fp8AllGatherWeight, enable_fp8_all_gather, fp8_all_gather_names


def quant_dequant(w):
    """Tensorwise E4M3 with scale = 448 / amax, saturating; back to fp32 as q / scale."""
    w = w.float()
    scale = torch.tensor(448.0) / w.abs().max().clamp(min=1e-12)
    return (w * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() / scale


class FakeMesh:
    """What fsdp_pre_all_gather uses of a DeviceMesh: the group (here of 1 rank, so no
    all-reduce) and the shard count (here pretended, to exercise the padding)."""

    def __init__(self, size):
        self._size = size

    def get_group(self):
        return dist.group.WORLD

    def size(self):
        return self._size


def test_ops_keep_or_drop_the_subclass():
    w = Fp8AllGatherWeight(torch.randn(5, 3))
    for keep in (w.detach(), w.view(-1), w[1:3], w.narrow(0, 0, 2), w.new_zeros(4, 3), w.clone(), w.to(torch.float64)):
        assert type(keep) is Fp8AllGatherWeight
    assert all(type(c) is Fp8AllGatherWeight for c in torch.chunk(w, 2))
    for plain in (w * 2, w.sum(), torch.zeros_like(w), w.abs()):
        assert type(plain) is torch.Tensor
    # narrow + copy_ write through to the wrapped data, as FSDP's padding needs
    padded = w.new_zeros(6, 3)
    padded.narrow(0, 0, 5).copy_(w)
    assert torch.equal(padded._tensor[:5], w._tensor) and torch.equal(padded._tensor[5], torch.zeros(3))


def test_in_place_ops_return_the_mutated_wrapper():
    w = Fp8AllGatherWeight(torch.ones(4))
    assert w.add_(1) is w
    assert w.mul_(torch.full((4,), 3.0)) is w
    assert torch.equal(w._tensor, torch.full((4,), 6.0))
    p = nn.Parameter(w)
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.ones(4)
    opt.step()
    assert type(p) is Fp8AllGatherWeight and isinstance(p, nn.Parameter)
    assert torch.all(p._tensor < 6.0)
    assert type(opt.state[p]["exp_avg"]) is torch.Tensor  # optimizer states stay plain


def test_pre_all_gather_sends_padded_uint8_and_the_scale(world_of_one):
    shard = torch.tensor([[1.0, -2.0, 0.5], [100.0, 3.0, -0.25]])
    w = Fp8AllGatherWeight(shard)
    # Pretend 2 shards of a 3-row weight: this rank holds 2 rows, ceil(3 / 2) = 2, no padding;
    # of a 5-row weight over 3 shards the last rank holds 1 row and pads to 2.
    (data,), (scale,) = w.fsdp_pre_all_gather(FakeMesh(2), torch.Size([3, 3]), (3, 1), None, None)
    assert data.dtype == torch.uint8 and data.shape == (2, 3)
    assert scale.item() == pytest.approx(448.0 / 100.0)
    assert torch.equal(data.view(torch.float8_e4m3fn).float() / scale, quant_dequant(shard))
    (short,), _ = Fp8AllGatherWeight(shard[:1]).fsdp_pre_all_gather(FakeMesh(3), torch.Size([5, 3]), (3, 1), None, None)
    assert short.shape == (2, 3) and torch.equal(short[1], torch.zeros(3, dtype=torch.uint8))
    (empty,), (empty_scale,) = Fp8AllGatherWeight(shard[:0]).fsdp_pre_all_gather(
        FakeMesh(2), torch.Size([1, 3]), (3, 1), None, None
    )
    assert empty.shape == (1, 3) and torch.isfinite(empty_scale)


def test_post_all_gather_dequantizes_to_fp32_and_refills_out(world_of_one):
    w = Fp8AllGatherWeight(torch.randn(4, 3).bfloat16())
    (data,), meta = w.fsdp_pre_all_gather(FakeMesh(1), torch.Size([4, 3]), (3, 1), None, None)
    values, inner = w.fsdp_post_all_gather((data,), meta, torch.bfloat16)
    assert values.dtype == torch.float32 and inner == (values,)
    assert torch.equal(values, quant_dequant(w._tensor))
    out = nn.Parameter(torch.empty(4, 3))
    version = out._version
    assert w.fsdp_post_all_gather((data,), meta, torch.bfloat16, out=out) is None
    assert torch.equal(out.detach(), values) and out._version == version


def test_requantizing_the_gathered_weight_gives_the_same_fp8_values():
    # Why the gathered weight is fp32: the consumer's own tensorwise quantization of it must
    # reproduce the fp8 bytes that were sent (amax survives up to fp32 rounding).
    def quant(w):
        scale = torch.tensor(448.0) / w.abs().max().clamp(min=1e-12)
        return (w * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale

    torch.manual_seed(0)
    for _ in range(500):
        w = torch.randn(32, 16) * torch.exp(torch.randn(()) * 8)  # amaxes over ~e^+-30
        w[0, 0] = -w.abs().max() * 1.5  # a negative amax element
        w[1, :4] = w[0, 0] * 1e-6  # below the smallest fp8 subnormal after scaling
        q, scale = quant(w)
        gathered = q.float() / scale
        q_again, scale_again = quant(gathered)
        assert torch.equal(q_again.view(torch.uint8), q.view(torch.uint8))
        assert torch.allclose(q_again.float() / scale_again, gathered, rtol=2e-7, atol=0)


def test_enable_replaces_weights_keeps_ties_and_state_dict_is_plain():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 3))
    model[2].weight = nn.Parameter(torch.randn(3, 4))
    head = nn.Linear(4, 3)
    head.weight = model[2].weight  # tied
    root = nn.ModuleDict({"body": model, "head": head})
    root.get_submodule("body.1").weight.requires_grad_(False)
    before = {k: v.detach().clone() for k, v in root.state_dict().items()}
    assert enable_fp8_all_gather(root, iter(["body.0", "body.1", "body.2"])) == ["body.0", "body.1", "body.2"]
    assert type(model[0].weight) is Fp8AllGatherWeight and isinstance(model[0].weight, nn.Parameter)
    assert model[1].weight.requires_grad is False and model[0].weight.requires_grad is True
    assert head.weight is model[2].weight  # the tie survives
    assert fp8_all_gather_names(root) == ["body.0.weight", "body.1.weight", "body.2.weight"]
    enable_fp8_all_gather(root, ["body.0"])  # idempotent
    assert fp8_all_gather_names(root) == ["body.0.weight", "body.1.weight", "body.2.weight"]

    sd = root.state_dict()
    assert all(type(v) is torch.Tensor for v in sd.values())
    assert root.state_dict(keep_vars=True)["body.0.weight"] is model[0].weight
    assert all(torch.equal(sd[k], before[k]) for k in before)
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    with torch.no_grad():
        for p in root.parameters():
            p.zero_()
    root.load_state_dict(loaded)
    assert type(model[0].weight) is Fp8AllGatherWeight
    assert torch.equal(model[0].weight._tensor, before["body.0.weight"])

    clone = copy.deepcopy(root)
    assert type(clone["body"][0].weight) is Fp8AllGatherWeight
    assert clone["head"].weight is clone["body"][2].weight
    assert clone["body"][0].weight._tensor.data_ptr() != model[0].weight._tensor.data_ptr()


def test_enable_rejects_what_it_cannot_convert(world_of_one):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with pytest.raises(TypeError, match="no weight Parameter"):
        enable_fp8_all_gather(nn.Sequential(nn.ReLU()), ["0"])
    emb = nn.Module()
    emb.weight = nn.Parameter(torch.zeros(3, dtype=torch.float8_e4m3fn), requires_grad=False)
    with pytest.raises(TypeError, match="high-precision"):
        enable_fp8_all_gather(nn.ModuleDict({"e": emb}), ["e"])
    sharded = nn.Sequential(nn.Linear(3, 3))
    fully_shard(sharded, mesh=init_device_mesh("cpu", (1,)))
    with pytest.raises(ValueError, match="before fully_shard"):
        enable_fp8_all_gather(sharded, ["0"])


def test_fully_shard_on_one_rank_gathers_quantized_weights_and_trains(world_of_one):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 5), nn.Linear(5, 2))
    enable_fp8_all_gather(model, ["0", "1"])
    mesh = init_device_mesh("cpu", (1,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    seen = []
    model[0].register_forward_pre_hook(lambda m, a: seen.append(m.weight.detach().clone()))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for step in range(3):
        expected = quant_dequant(model[0].weight.full_tensor())
        F.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 2)).backward()
        assert torch.equal(seen[-1], expected)
        assert type(model[0].weight.grad.to_local()) is torch.Tensor
        opt.step()
        opt.zero_grad()
    assert type(model[0].weight.to_local()) is Fp8AllGatherWeight
    assert not torch.equal(seen[0], seen[-1])  # the optimizer steps reach the next all-gather
    assert all(type(v.to_local()) is torch.Tensor for v in model.state_dict().values())

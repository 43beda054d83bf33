"""ALiBi-style per-head attention biases under tensor parallelism (issue 22, the zoo's
nested_lists): each rank's attention call must get the full model's bias rows of its own heads."""

import copy

import torch
import torch.nn.functional as F
from torch import nn

from lightning_5d.parallel.tensor.head_bias import wrap_per_head_bias
from lightning_5d.parallel.tensor.sharding import TensorShard

DIM, HEADS, KV = 32, 4, 2
D = DIM // HEADS


def alibi(heads: int, n: int) -> torch.Tensor:
    slopes = torch.tensor([2 ** (-8 * (h + 1) / heads) for h in range(heads)])
    distance = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).float()
    return (slopes[:, None, None] * distance).masked_fill(distance > 0, float("-inf"))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads, self.kv_heads = HEADS, KV
        self.to_q = nn.Linear(DIM, DIM, bias=False)
        self.to_kv = nn.Linear(DIM, 2 * KV * D, bias=False)
        self.to_out = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.to_q(x).view(b, n, self.heads, D).transpose(1, 2)
        k, v = (t.view(b, n, self.kv_heads, D).transpose(1, 2) for t in self.to_kv(x).chunk(2, dim=-1))
        k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
        v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=alibi(self.heads, n))
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


def heads_output(attention: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The attention's per-head output (the input of to_out), as tp's row projection receives it."""
    seen = []
    handle = attention.to_out.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        attention(x)
    finally:
        handle.remove()
    return seen[0]


def rank_copy(full: Attention, rank: int, tp: int, wrap: bool) -> Attention:
    """What tensor parallelism makes of ``full`` on ``rank``: column cuts, local head counts."""
    local = copy.deepcopy(full)
    cuts = {local.to_q: TensorShard(0), local.to_kv: TensorShard(0, (KV * D, KV * D))}
    widths = {m: m.weight.size(0) for m in cuts}
    for module, shard in cuts.items():
        module.weight = nn.Parameter(shard.take(module.weight.detach(), rank, tp).clone())
    local.to_out.weight = nn.Parameter(TensorShard(1).take(local.to_out.weight.detach(), rank, tp).clone())
    local.heads, local.kv_heads = HEADS // tp, KV // tp
    if wrap:
        wrap_per_head_bias(local, {"heads": HEADS, "kv_heads": KV}, widths, HEADS, rank, tp)
    return local


def test_each_rank_gets_the_bias_rows_of_its_own_heads():
    tp = 2  # KV = 2: each rank needs a whole kv head
    torch.manual_seed(0)
    full = Attention()
    x = torch.randn(2, 6, DIM)
    want = heads_output(full, x).detach()
    per_rank = DIM // tp
    for rank in range(tp):
        got = heads_output(rank_copy(full, rank, tp, wrap=True), x)
        torch.testing.assert_close(got, want[..., rank * per_rank : (rank + 1) * per_rank])


def test_without_the_wrap_the_local_head_count_gives_other_slopes():
    # What the wrap fixes: rank 1's heads would get the slopes of heads 0 and 1.
    torch.manual_seed(0)
    full = Attention()
    x = torch.randn(2, 6, DIM)
    want = heads_output(full, x).detach()[..., DIM // 2 :]
    assert not torch.allclose(heads_output(rank_copy(full, 1, 2, wrap=False), x), want)


def test_the_replay_is_invisible_to_hooks_and_leaves_the_module_as_it_was():
    torch.manual_seed(0)
    local = rank_copy(Attention(), 0, 2, wrap=True)
    widths = []
    local.to_kv.register_forward_hook(lambda _m, _a, out: widths.append(out.size(-1)))
    out = local(torch.randn(1, 5, DIM))
    assert widths == [KV * D]  # the real call only, at the rank's width (not the replay's zeros)
    assert (local.heads, local.kv_heads) == (HEADS // 2, KV // 2)
    assert "forward" not in vars(local.to_kv) and "forward" not in vars(local.to_q)
    out.sum().backward()
    assert local.to_q.weight.grad is not None and local.to_kv.weight.grad is not None

"""A forward that raises inside a sequence-parallel region must leave no saved-tensor hooks
entered (issue 22, note 10: a hang in a long launch of zoo cells, the cell after one whose
probe forward raised under tp2+sp)."""

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lightning_5d.parallel.tensor.sharding import TensorParallel
from lightning_5d.plan import discover

VOCAB, DIM = 32, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.num_heads = 2
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self.self_attn, name, nn.Linear(DIM, DIM))
        self.self_attn.forward = self._attention
        self.up_proj, self.down_proj = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)
        self.fail = False

    def _attention(self, x):
        a = self.self_attn
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, 2, -1).transpose(1, 2) for p in (a.q_proj, a.k_proj, a.v_proj))
        if self.fail:
            raise ValueError("the probe cannot run this")
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return a.o_proj(y.transpose(1, 2).reshape(b, s, -1))

    def forward(self, x):
        x = x + self.self_attn(x)
        return x + self.down_proj(torch.relu(self.up_proj(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block() for _ in range(2)])
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


def saved_tensor_hooks_entered() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def test_a_raising_forward_leaves_the_region(world_of_one):
    torch.manual_seed(0)
    model = Model()
    plan = discover(model)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    TensorParallel(model, plan, mesh, sequence_parallel=True)
    ids = torch.randint(0, VOCAB, (2, 4))
    model(ids).sum().backward()  # the regions work
    assert not saved_tensor_hooks_entered()
    model.layers[1].fail = True
    with pytest.raises(ValueError, match="the probe cannot run this"):
        model(ids)
    assert not saved_tensor_hooks_entered()

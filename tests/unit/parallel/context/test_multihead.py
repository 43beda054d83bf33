"""nn.MultiheadAttention under cp: its forward from its parts calls SDPA where the route reaches it,
a causal mask (float, bool, per head) becomes ring attention's causal flag, and what ring attention
cannot honour is refused with its fix."""

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lightning_5d.config import ContextConfig
from lightning_5d.mha_parts import MhaPartsError
from lightning_5d.parallel.context.attention import route_attention
from lightning_5d.parallel.context.batch import ContextParallelError, shard_batch
from lightning_5d.parallel.context.state import ContextState
from lightning_5d.parallel.context.multihead import is_causal_mask, ring_masks
from lightning_5d.plan import discover

L = 6


def _causal(n=L):
    return nn.Transformer.generate_square_subsequent_mask(n)


class EncoderLM(nn.Module):
    """nn.TransformerEncoder with a causal mask (the PyTorch tutorial's model, no positions)."""

    def __init__(self, **attention) -> None:
        super().__init__()
        self.embedding = nn.Embedding(40, 16)
        layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(16), enable_nested_tensor=False)
        if attention:
            for layer in self.encoder.layers:
                layer.self_attn = nn.MultiheadAttention(16, 4, batch_first=True, **attention)
        self.decoder = nn.Linear(16, 40)

    def forward(self, ids):
        mask = nn.Transformer.generate_square_subsequent_mask(ids.size(1))
        return self.decoder(self.encoder(self.embedding(ids), mask=mask, is_causal=True))


def test_causal_masks_are_recognized_in_every_form():
    assert is_causal_mask(_causal(), L, L)
    bool_causal = torch.ones(L, L, dtype=torch.bool).triu(1)
    assert is_causal_mask(torch.zeros(L, L).masked_fill(bool_causal, float("-inf")), L, L)
    assert is_causal_mask(torch.zeros(L, L).masked_fill(bool_causal, torch.finfo(torch.float32).min), L, L)
    assert is_causal_mask(_causal().expand(8, L, L), L, L)  # per head
    assert not is_causal_mask(_causal(L)[:, :-1], L, L - 1)
    assert not is_causal_mask(_causal().T, L, L)
    shifted = _causal().clone()
    shifted[3, 3] = float("-inf")  # a query that may not see itself
    assert not is_causal_mask(shifted, L, L)
    biased = _causal() + torch.tril(torch.ones(L, L))  # a bias below the diagonal
    assert not is_causal_mask(biased, L, L)


def test_ring_masks_turn_causal_into_the_flag_and_refuse_the_rest(world_of_one):
    cp = SimpleNamespace(size=2, current=object(), group=None)
    assert ring_masks(cp, "a", _causal(), None, False, L, L) == (None, True)
    assert ring_masks(cp, "a", None, None, True, L, L) == (None, True)
    assert ring_masks(cp, "a", None, None, False, L, L) == (None, False)  # full attention (no mask)
    with pytest.raises(ContextParallelError, match="a .*key_padding_mask.*label -100.*cp=1"):
        ring_masks(cp, "a", None, torch.zeros(2, L), False, L, L)
    with pytest.raises(ContextParallelError, match="not a causal mask.*generate_square_subsequent_mask"):
        ring_masks(cp, "a", torch.randn(L, L), None, False, L, L)
    outside = SimpleNamespace(size=2, current=None, group=None)  # no step: masks as given
    mask = torch.randn(L, L)
    assert ring_masks(outside, "a", mask, None, False, L, L) == (mask, False)


@pytest.mark.parametrize("setting", [{"add_bias_kv": True}, {"add_zero_attn": True}])
def test_extra_key_positions_are_refused_at_setup(setting):
    model = EncoderLM(**setting)
    cp = SimpleNamespace(size=2, undo=[])
    with pytest.raises(ContextParallelError, match=f"{next(iter(setting))}=True.*cp=1"):
        route_attention(cp, model, discover(model), [])


def test_a_cp_of_one_runs_the_routed_attention_as_the_model(world_of_one):
    """Routed through ring attention (over one rank), with the mask the model builds: torch's numbers."""
    torch.manual_seed(0)
    model = EncoderLM()
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
    cp = ContextState(mesh["cp"], ContextConfig())
    route_attention(cp, model, discover(model), [])
    ids = torch.randint(0, 40, (2, 8))
    cp.current = shard_batch({"input_ids": ids, "labels": ids}, 0, 1, cp.sharding)
    out = model(ids)
    assert cp.attention_calls == 2  # both blocks' SDPA calls went through ring attention
    torch.testing.assert_close(out, reference(ids), rtol=1e-5, atol=1e-5)
    attention = model.encoder.layers[0].self_attn
    x = torch.randn(2, 8, 16)
    with pytest.raises(MhaPartsError, match="need_weights=True.*cp=1.*Pass need_weights=False"):
        attention(x, x, x)
    for undo in reversed(cp.undo):
        undo()

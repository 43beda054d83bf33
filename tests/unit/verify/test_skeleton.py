"""Weightless copies of the pieces, rebuilt one at a time with full weights (single process)."""

import math

import torch
from torch import nn

from lightning_5d.models import LlamaConfig, LlamaLM
from lightning_5d.plan import discover
from lightning_5d.verify.gather import ActivationLayout
from lightning_5d.verify.probe import _backbone_path, probe_seq_len
from lightning_5d.verify.skeleton import PieceKind, materialize, take_skeleton, tensor_names

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


class ScaledEmbedding(nn.Embedding):
    def forward(self, ids):
        return super().forward(ids) * math.sqrt(self.embedding_dim)


def test_skeleton_holds_no_storage_and_keeps_the_pieces_code():
    module = LlamaLM(CONFIG)
    module.model.embed_tokens = ScaledEmbedding(64, 32)
    pieces = take_skeleton(module, discover(module))
    assert [p.kind for p in pieces] == [PieceKind.EMBEDDING, PieceKind.BLOCK, PieceKind.BLOCK,
                                        PieceKind.FINAL_NORM, PieceKind.HEAD]  # fmt: skip
    assert [p.name for p in pieces][1:3] == ["block 0", "block 1"]
    for piece in pieces:
        assert all(t.is_meta for t in [*piece.copy.parameters(), *piece.copy.buffers()])
    assert type(pieces[0].copy) is ScaledEmbedding  # the subclass's forward (its scale) is kept


def test_materialized_piece_computes_what_the_original_does():
    torch.manual_seed(0)
    module = LlamaLM(CONFIG)
    plan = discover(module)
    block = module.model.layers[1]
    piece = take_skeleton(module, plan)[2]
    full = {n: t.detach().clone() for n, t in [*block.named_parameters(), *block.named_buffers()]}
    assert set(full) == set(tensor_names(piece.copy))
    reference = materialize(piece, full, torch.device("cpu"))
    x, pos = torch.randn(2, 8, 32), torch.arange(8)
    torch.testing.assert_close(reference(x, pos), block(x, pos), rtol=0, atol=0)
    assert all(p.dtype == torch.float32 and not p.requires_grad for p in reference.parameters())


def test_probe_sequence_is_cut_by_every_layout():
    for tp, sp, cp in [(1, False, 1), (2, True, 1), (4, True, 2), (2, False, 8)]:
        s = probe_seq_len(tp, sp, cp)
        assert s >= 16 and s % (2 * cp * (tp if sp else 1)) == 0


def test_unsplit_layout_leaves_activations_as_they_are():
    layout = ActivationLayout(seq_len=16)
    x = torch.randn(1, 16, 8)
    assert layout.full((x, {"p": torch.arange(16)}))[0] is x


def test_backbone_is_the_module_holding_embedding_blocks_and_head():
    plan = discover(LlamaLM(CONFIG))
    assert _backbone_path(plan) == "model"


def test_a_key_value_cache_is_not_handed_to_the_reference():
    from lightning_5d.verify.check import _float

    class Cache:  # the name Hugging Face's cache classes derive from
        pass

    class DynamicCache(Cache):
        pass

    args = (torch.ones(2, dtype=torch.float64), DynamicCache(), torch.arange(3))
    out = _float(args)
    assert out[0].dtype == torch.float32 and out[1] is None and out[2].dtype == torch.long


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm(x)
        q, k, v = (p(h).view(b, s, 4, 4).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, 16))


class NestedLM(nn.Module):
    """``for attn, ff in self.layers``: each block an nn.ModuleList the model's loop opens."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 16)
        ff = lambda: nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))  # noqa: E731
        self.layers = nn.ModuleList(nn.ModuleList([Attention(), ff()]) for _ in range(2))
        self.norm = nn.LayerNorm(16)
        self.lm_head = nn.Linear(16, 40)

    def forward(self, ids):
        x = self.embed(ids)
        for attn, ff in self.layers:
            x = x + attn(x)
            x = x + ff(x)
        return self.lm_head(self.norm(x))


def test_a_container_block_is_one_piece_per_sub_layer_each_with_its_own_inner_modules():
    from lightning_5d.verify.probe import inner_paths

    model = NestedLM()
    plan = discover(model, {"layers.*.0": "attention(heads=4)"})
    blocks = [p for p in take_skeleton(model, plan) if p.kind == PieceKind.BLOCK]
    assert [(p.name, p.path) for p in blocks] == [
        ("block 0 [0]", "layers.0.0"), ("block 0 [1]", "layers.0.1"),
        ("block 1 [0]", "layers.1.0"), ("block 1 [1]", "layers.1.1"),
    ]  # fmt: skip
    assert type(blocks[0].copy) is Attention and isinstance(blocks[1].copy, nn.Sequential)
    # Inside each sub-layer, relative to it: the projections and what the plan names there.
    assert [p for p, _ in inner_paths(blocks[0])] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert [p for p, _ in inner_paths(blocks[1])] == ["1", "3"]
    # Each sub-layer rebuilt alone computes what the model's does.
    attn = model.layers[1][0]
    full = {n: t.detach().clone() for n, t in [*attn.named_parameters(), *attn.named_buffers()]}
    x = torch.randn(2, 8, 16)
    torch.testing.assert_close(materialize(blocks[2], full, torch.device("cpu"))(x), attn(x), rtol=0, atol=0)


def test_a_block_with_a_forward_stays_one_piece_and_parameterless_sub_layers_are_left_out():
    from lightning_5d.verify.skeleton import sub_layers

    assert sub_layers(LlamaLM(CONFIG).model.layers[0]) is None
    nested = nn.ModuleList([nn.ModuleDict({"attn": nn.Linear(4, 4), "act": nn.GELU()}), nn.Linear(4, 4)])
    assert [rel for rel, _ in sub_layers(nested)] == ["0.attn", "1"]


def test_the_reference_piece_runs_in_eval_mode_like_the_probe():
    block = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))  # built in training mode, as at setup
    piece = take_skeleton(nn.ModuleDict({"layers": nn.ModuleList([block])}), None)[0]
    full = {n: t.detach().clone() for n, t in block.named_parameters()}
    reference = materialize(piece, full, torch.device("cpu"))
    x = torch.randn(4, 8)
    assert not reference.training and torch.equal(reference(x), reference(x))


def test_a_tensor_the_rank_holds_whole_is_shared_or_copied_as_asked():
    """SHARE: the reference piece uses the live weights in place (no second copy), and its
    backward leaves the live parameters untouched; COPY: its own tensors (FSDP2's unsharded
    parameters go away when the unit reshards)."""
    from lightning_5d.verify.gather import HeldTensors, full_weights
    from lightning_5d.verify.grads import reference_grads, trainable_names

    torch.manual_seed(0)
    module = LlamaLM(CONFIG)
    block = module.model.layers[0]
    piece = take_skeleton(module, discover(module))[1]
    names = tensor_names(piece.copy)
    weight = block.attention.q_proj.weight
    shared = full_weights(block, "model.layers.0", names, None, HeldTensors.SHARE)
    assert shared["attention.q_proj.weight"].data_ptr() == weight.data_ptr()
    copied = full_weights(block, "model.layers.0", names, None, HeldTensors.COPY)
    assert all(copied[n].data_ptr() != t.data_ptr() for n, t in [*block.named_parameters(), *block.named_buffers()])
    reference = materialize(piece, shared, torch.device("cpu"), trainable=True)
    assert reference.attention.q_proj.weight.data_ptr() == weight.data_ptr()
    assert all(b.data_ptr() != live.data_ptr() for b, live in zip(reference.buffers(), block.buffers()))
    before = weight.detach().clone()
    x, pos = torch.randn(2, 8, 32), torch.arange(8)
    grads = reference_grads(reference, trainable_names(piece.copy), reference(x, pos))
    assert grads["attention.q_proj.weight"].abs().sum() > 0
    assert weight.grad is None and torch.equal(weight, before)

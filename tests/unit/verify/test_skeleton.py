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

"""Which modules outside the blocks get a ZeRO-3 unit of their own (parallel/data/fsdp.py)."""

from dataclasses import replace

import torch
from torch import nn

from lightning_5d.models.llama import LlamaConfig, LlamaModel
from lightning_5d.parallel.data.fsdp import _outer_units

CONFIG = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1)


def units_of(model: nn.Module, in_pipeline: bool = False):
    blocks = list(model.layers)
    taken = {id(p) for b in blocks for p in b.parameters()}
    return _outer_units(model, blocks, taken, in_pipeline=in_pipeline)


def test_untied_embedding_alone_then_norm_and_head_each_alone():
    with torch.device("meta"):
        model = LlamaModel(CONFIG)
    (emb, emb_reshard), (norm, norm_reshard), (head, head_reshard) = units_of(model)
    assert emb is model.embed_tokens and emb_reshard  # used first in forward, last in backward
    # Last in forward, first in backward: both stay gathered. The head, one parameter, is a unit
    # of its own so that it gathers in place (gather_in_place.py).
    assert norm is model.norm and head is model.lm_head and not norm_reshard and not head_reshard


def test_a_head_with_a_bias_shares_the_norms_unit():
    """Only a one-parameter leaf gathers in place: a head with a bias stays with the norm."""
    with torch.device("meta"):
        model = LlamaModel(CONFIG)
        model.lm_head = nn.Linear(CONFIG.hidden_size, CONFIG.vocab_size)
    (_, _), (rest, _) = units_of(model)
    assert rest == [model.norm, model.lm_head]


def test_tied_head_stays_with_its_embedding_in_the_root():
    with torch.device("meta"):
        model = LlamaModel(replace(CONFIG, tie_embeddings=True))
    assert units_of(model) == [(model.norm, False)]


def test_under_pp_the_embedding_stays_gathered_across_microbatches():
    with torch.device("meta"):
        model = LlamaModel(CONFIG)
    assert [reshard for _, reshard in units_of(model, in_pipeline=True)] == [False, False, False]


def test_a_module_with_parameters_and_parameterized_children_stays_in_the_root():
    class Head(nn.Module):  # reads its child's weight itself: a unit on the child would miss it
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(16))
            self.proj = nn.Linear(16, 32)

    with torch.device("meta"):
        model = LlamaModel(CONFIG)
        model.lm_head = Head()
    (emb, _), (rest, _) = units_of(model)
    assert emb is model.embed_tokens
    assert rest is model.norm  # lm_head and its proj: in the root, gathered by its hooks

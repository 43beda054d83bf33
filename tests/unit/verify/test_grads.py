"""The verifier's backward per piece (single process: no tp or cp sums)."""

import torch
from torch import nn

from lightning_5d.verify.grads import cotangent, parallel_grads, reference_grads, trainable_names


def test_the_cotangent_of_a_shard_is_the_shard_of_the_cotangent():
    y = torch.randn(2, 8, 16)
    for dim in (1, 2):  # a sequence shard (SP, cp), a column / vocabulary shard (tp)
        for part, cut in zip(y.chunk(2, dim), cotangent(y).chunk(2, dim)):
            assert torch.equal(cotangent(part), cut)


def test_gradients_are_taken_for_the_pieces_own_parameters_only():
    torch.manual_seed(0)
    before, piece = nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    piece[1].weight.requires_grad_(False)  # frozen: not compared
    x = torch.randn(3, 4)
    y = piece(before(x))
    names = trainable_names(piece)
    assert names == ["0.weight", "0.bias", "1.bias"]
    grads = parallel_grads(piece, "piece", names, y, tp=None, cp=None)
    assert before.weight.grad is None  # nothing accumulated, no earlier piece's backward
    again = reference_grads(piece, names, piece(before(x).detach()))
    for name in names:
        torch.testing.assert_close(grads[name], again[name])
    assert grads["0.weight"].abs().sum() > 0

"""``nested_lists`` as the pipeline and sequence-parallel refusals advise: each ``[attn, ff]``
pair in a ``Block`` module with a forward (a stage boundary and the sequence cut are hooks on
a block's forward; a list the model iterates has none). Attention, ALiBi biases and the
feed-forward are nested_lists' own.
"""

from torch import nn

from zoo.adapter import Positional
from zoo.nested_lists import DEPTH, DIM, VOCAB, Attention


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention()
        self.ff = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        x = self.attn(x) + x
        return self.ff(x) + x


class BlocksLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.token_emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block() for _ in range(DEPTH)])
        self.norm = nn.LayerNorm(DIM)
        self.to_logits = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x):
        x = self.token_emb(x)
        for block in self.layers:
            x = block(x)
        return self.to_logits(self.norm(x))


def build() -> Positional:
    return Positional(BlocksLM())

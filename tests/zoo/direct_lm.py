"""Parameters held directly on the LightningModule: the embedding, an ``nn.ModuleList`` of
blocks, the final norm and the head are attributes of the LightningModule itself (no inner
model). Attention is grouped-query (4 query heads share 2 key/value heads) with the heads
read from shapes only: ``view(b, s, -1, self.head_dim)``, the group size from
``q.size(2) // k.size(2)``. No position encoding at all (NoPE: the causal mask alone orders
the tokens). GELU feed-forward ``fc1``/``fc2`` with biases.
"""

import torch.nn.functional as F
from torch import nn

from zoo.adapter import ZooLM

VOCAB, DIM, HEAD_DIM, KV_DIM, LAYERS = 256, 64, 16, 32, 2


class GroupedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = HEAD_DIM
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, KV_DIM, bias=False)
        self.wv = nn.Linear(DIM, KV_DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        groups = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.attention = GroupedAttention()
        self.norm2 = nn.LayerNorm(DIM)
        self.feed_forward = FeedForward()

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.feed_forward(self.norm2(x))


class DirectLM(ZooLM):
    """The LightningModule is the model."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.final_norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def logits(self, input_ids):
        x = self.embedding(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.final_norm(x))


def build() -> DirectLM:
    return DirectLM()

"""nn.TransformerEncoder (nn.MultiheadAttention inside) under TP / TP+SP, one forward and backward
against the same model in this process, for the settings the zoo's model does not use.

Cases (``--case``): ``seq_first_padding`` (batch_first=False, post-norm, a bool causal mask and a
key_padding_mask that hides the last tokens of one sequence) and ``batch_first_causal`` (the zoo
model's shape: batch_first, pre-norm, a float causal mask with is_causal=True). Every rank builds
the full model from one seed, runs it unsharded (the reference), then cuts it with
``TensorParallel`` and compares the loss and every gathered gradient, and the state dict gathered
from the shards (and cut again) with the full one. Rank 0 writes result.json.
"""

import argparse
import json
import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lightning_5d.parallel.tensor.sharding import TensorParallel
from lightning_5d.parallel.tensor.vocab import loss_parallel_region
from lightning_5d.plan import discover
from lightning_5d.testing import leave_process_group

VOCAB, D, HEADS, FFN, BATCH, SEQ = 64, 32, 4, 64, 2, 8


class EncoderLM(nn.Module):
    def __init__(self, batch_first: bool, norm_first: bool):
        super().__init__()
        self.batch_first = batch_first
        self.embedding = nn.Embedding(VOCAB, D)
        layer = nn.TransformerEncoderLayer(D, HEADS, FFN, dropout=0.0, batch_first=batch_first, norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids, padding=None):
        x = self.embedding(ids) * math.sqrt(D)
        if self.batch_first:
            mask = nn.Transformer.generate_square_subsequent_mask(ids.size(1))
            return self.head(self.encoder(x, mask=mask, is_causal=True))
        mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
        out = self.encoder(x.transpose(0, 1), mask=mask, src_key_padding_mask=padding)
        return self.head(out.transpose(0, 1))


def loss_and_grads(model, ids, padding, tp=None):
    model.zero_grad()
    with loss_parallel_region():
        logits = model(ids, padding)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids.reshape(-1))
        loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        if tp is not None and tp.is_sharded(name):
            g = tp.shards[name].gather(g, tp.group, torch.device("cpu"))
        grads[name] = g
    return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss), grads


parser = argparse.ArgumentParser()
parser.add_argument("--case", choices=["seq_first_padding", "batch_first_causal"], required=True)
parser.add_argument("--sp", action="store_true")
parser.add_argument("--out", required=True)
args = parser.parse_args()

dist.init_process_group("gloo")
torch.manual_seed(0)
batch_first = args.case == "batch_first_causal"
model = EncoderLM(batch_first=batch_first, norm_first=batch_first)
ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
padding = None if batch_first else torch.tensor([[False] * SEQ, [False] * (SEQ - 3) + [True] * 3])
ref_loss, ref_grads = loss_and_grads(model, ids, padding)

full_state = {k: v.clone() for k, v in model.state_dict().items()}
mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
tp = TensorParallel(model, discover(model), mesh["tp"], sequence_parallel=args.sp)
# Checkpoints: the names stay; the shards gather back to the full tensors and cut again from them.
local_state = model.state_dict()
gathered = tp.full_state(local_state)
state_round_trip = gathered.keys() == full_state.keys()
state_round_trip = state_round_trip and all(torch.equal(gathered[k], full_state[k]) for k in full_state)
recut = tp.local_state(full_state)
state_round_trip = state_round_trip and all(torch.equal(recut[k], local_state[k]) for k in local_state)
if args.sp:
    tp.register_sequence_parallel_grad_hooks(model)
loss, grads = loss_and_grads(model, ids, padding, tp)

errors = {n: float((grads[n] - g).norm() / g.norm().clamp_min(1e-12)) for n, g in ref_grads.items() if g is not None}
if dist.get_rank() == 0:
    result = {"loss": loss, "ref_loss": ref_loss, "grad_errors": errors, "sharded": sorted(tp.shards),
              "state_round_trip": state_round_trip}  # fmt: skip
    Path(args.out, "result.json").write_text(json.dumps(result))
leave_process_group()

"""nn.TransformerEncoder (nn.MultiheadAttention inside) under TP / TP+SP, one forward and backward
against the same model in this process, for the settings the zoo's model does not use.

Cases (``--case``, ``CASES``): ``seq_first_padding`` (batch_first=False, post-norm, a bool causal
mask and a key_padding_mask that hides the last tokens of one sequence), ``batch_first_causal``
(the zoo model's shape: batch_first, pre-norm, a float causal mask with is_causal=True) and
``batch_first_padding`` (post-norm, a padding mask only, nested tensors enabled: in eval mode
without grad torch would run its fused nested-tensor path; the logits are compared there too). Every rank builds
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


# case -> (batch_first, norm_first, causal mask, key padding mask, nested-tensor inference path)
CASES = {
    "seq_first_padding": (False, False, True, True, False),
    "batch_first_causal": (True, True, True, False, False),
    "batch_first_padding": (True, False, False, True, True),  # also compared in eval mode
}


class EncoderLM(nn.Module):
    def __init__(self, batch_first: bool, norm_first: bool, causal: bool, nested: bool):
        super().__init__()
        self.batch_first, self.causal = batch_first, causal
        self.embedding = nn.Embedding(VOCAB, D)
        layer = nn.TransformerEncoderLayer(D, HEADS, FFN, dropout=0.0, batch_first=batch_first, norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids, padding=None):
        x = self.embedding(ids) * math.sqrt(D)
        x = x if self.batch_first else x.transpose(0, 1)
        if self.causal and self.batch_first:  # a float mask with the is_causal hint
            kwargs = {"mask": nn.Transformer.generate_square_subsequent_mask(SEQ), "is_causal": True}
        elif self.causal:  # a bool mask: True where attention is not allowed
            kwargs = {"mask": torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)}
        else:
            kwargs = {}
        out = self.encoder(x, src_key_padding_mask=padding, **kwargs)
        return self.head(out if self.batch_first else out.transpose(0, 1))


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
parser.add_argument("--case", choices=list(CASES), required=True)
parser.add_argument("--sp", action="store_true")
parser.add_argument("--out", required=True)
args = parser.parse_args()

dist.init_process_group("gloo")
torch.manual_seed(0)
batch_first, norm_first, causal, padded, nested = CASES[args.case]
model = EncoderLM(batch_first, norm_first, causal, nested)
ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
padding = torch.tensor([[False] * SEQ, [False] * (SEQ - 3) + [True] * 3]) if padded else None
ref_loss, ref_grads = loss_and_grads(model, ids, padding)


def eval_logits(model):
    """Inference (eval, no grad): torch's nested-tensor path where the model allows it."""
    model.eval()
    with torch.no_grad(), loss_parallel_region():
        logits = model(ids, padding)
    model.train()
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    return logits[~padding] if padding is not None else logits  # padded positions: zeros on the nested path


ref_eval = eval_logits(model) if nested else None

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

eval_error = float((eval_logits(model) - ref_eval).norm() / ref_eval.norm()) if nested else None
errors = {n: float((grads[n] - g).norm() / g.norm().clamp_min(1e-12)) for n, g in ref_grads.items() if g is not None}
if dist.get_rank() == 0:
    result = {"loss": loss, "ref_loss": ref_loss, "grad_errors": errors, "sharded": sorted(tp.shards),
              "state_round_trip": state_round_trip, "eval_error": eval_error}  # fmt: skip
    Path(args.out, "result.json").write_text(json.dumps(result))
leave_process_group()

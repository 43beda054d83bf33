"""Collectives and saved activations of one transformer block under TP / TP+SP.

Runs the reference model (3 blocks) forward and backward on ``tp`` ranks and records, for
the middle block only (no embedding, head or sequence scatter/gather at its edges), every
collective launched in its forward and in its backward, and the bytes autograd saves in
its forward. Rank 0 writes them to result.json.
"""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from lightning_5d.accounting import SavedActivationMeter
from lightning_5d.collectives import CollectiveCounter
from lightning_5d.models.llama import LlamaConfig, LlamaModel
from lightning_5d.parallel.tensor.sharding import TensorParallel
from lightning_5d.parallel.tensor.vocab import loss_parallel_region
from lightning_5d.plan import discover
from lightning_5d.testing import leave_process_group

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=["none", "tp", "tp_sp"], required=True)
parser.add_argument("--out", required=True)
args = parser.parse_args()

dist.init_process_group("gloo")
world = dist.get_world_size()
CFG = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=256, num_layers=3, num_heads=8, num_kv_heads=4)
BATCH, SEQ = 2, 64
torch.manual_seed(0)
model = LlamaModel(CFG)
tp = None
if args.mode != "none":
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    tp = TensorParallel(model, discover(model), mesh["tp"], sequence_parallel=args.mode == "tp_sp")
    if tp.sequence_parallel:
        tp.register_sequence_parallel_grad_hooks(model)

block = model.layers[1]
counter = CollectiveCounter()
marks: dict[str, int] = {}
meter = SavedActivationMeter()
block.register_forward_pre_hook(lambda *_: (marks.__setitem__("fwd0", len(counter.calls)), meter.__enter__()) and None)
block.register_forward_hook(
    lambda *_: (marks.__setitem__("fwd1", len(counter.calls)), meter.__exit__(None, None, None)) and None
)
block.register_full_backward_pre_hook(lambda *_: marks.__setitem__("bwd0", len(counter.calls)))
block.register_full_backward_hook(lambda *_: marks.__setitem__("bwd1", len(counter.calls)))

ids = torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
with counter, loss_parallel_region():
    logits = model(ids)
    loss = F.cross_entropy(logits.view(-1, CFG.vocab_size), ids.view(-1))
    loss.backward()


def calls(a, b):
    return [{"op": c.op, "bytes": c.tensor_bytes, "group": c.group_size} for c in counter.calls[marks[a] : marks[b]]]


if dist.get_rank() == 0:
    result = {
        "forward": calls("fwd0", "fwd1"),
        "backward": calls("bwd0", "bwd1"),
        "saved_bytes": meter.bytes,
        "activation_bytes": BATCH * SEQ * CFG.hidden_size * 4,
        "sequence_partial_per_block": sorted(
            n for n in (tp.sequence_partial if tp else ()) if n.startswith("layers.1.")
        ),
    }
    Path(args.out, "result.json").write_text(json.dumps(result))
leave_process_group()

"""One forward + backward of the reference MoE model under ExpertParallel, checked layer by layer.

Every rank feeds its own tokens. For each MoE layer the script recomputes the router's
assignments from the layer's input and compares them with the all-to-all split sizes the
dispatch used; it counts the bytes each all-to-all carried (CollectiveCounter); and it runs
a full, un-sharded copy of the layer on the same input to compare the outputs of tokens
whose assignments were all kept. Rank 0 writes what every rank found to --out.
"""

import argparse
import copy
import json
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_5d.collectives import CollectiveCounter
from lightning_5d.config import ExpertConfig, ParallelConfig
from lightning_5d.mesh import ParallelMesh
from lightning_5d.models.llama import LlamaLM
from lightning_5d.parallel.expert.moe import ExpertParallel
from lightning_5d.plan import discover
from lightning_5d.testing import leave_process_group
from tests_support import MODELS

parser = argparse.ArgumentParser()
parser.add_argument("--capacity-factor", type=float, default=None)
parser.add_argument("--drop-policy", default="probability")
parser.add_argument("--out", required=True)
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
config = replace(MODELS["tiny_moe"], num_shared_experts=0)
torch.manual_seed(0)
model = LlamaLM(config)
full_layers = [copy.deepcopy(block.moe) for block in model.model.layers]  # before ep slices the experts
mesh = ParallelMesh(ParallelConfig(dp_shard=world, ep=world).resolve(world), "cpu")
expert_config = ExpertConfig(capacity_factor=args.capacity_factor, drop_policy=args.drop_policy)
ep = ExpertParallel(model, discover(model), mesh, expert_config)
model.train()

inputs, outputs = [], []
for block in model.model.layers:
    block.moe.register_forward_pre_hook(lambda m, a: inputs.append(a[0].detach().reshape(-1, a[0].shape[-1])))
    block.moe.register_forward_hook(lambda m, a, out: outputs.append(out.detach().reshape(-1, out.shape[-1])))

ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(100 + rank))
ep.start_step()
with CollectiveCounter() as forward_count:
    logits = model(ids)
with CollectiveCounter() as backward_count:
    logits.float().square().mean().backward()

k, hidden, E = config.experts_top_k, config.hidden_size, config.num_experts
layers = []
for i, (plan, x, out) in enumerate(zip(ep.last_plans, inputs, outputs)):
    moe = full_layers[i]
    with torch.no_grad():
        probs = moe.router(x).float().softmax(dim=-1)
        assigned = probs.topk(k, dim=-1).indices
        reference = moe(x)
    by_owner = torch.bincount(assigned.flatten() // (E // world), minlength=world)
    kept_fully = torch.bincount(plan.tokens, minlength=len(x)) == k
    layers.append(
        {
            "tokens": len(x),
            "send_splits": plan.send_splits,
            "recv_splits": plan.recv_splits,
            "router_by_owner": by_owner.tolist(),
            "tokens_per_expert": plan.tokens_per_expert.tolist(),
            "kept_per_expert": plan.kept_per_expert.tolist(),
            "router_per_expert": torch.bincount(assigned.flatten(), minlength=E).tolist(),
            "dropped": plan.dropped,
            "kept_tokens": int(kept_fully.sum()),
            "kept_max_error": float((out[kept_fully] - reference[kept_fully]).abs().max()) if kept_fully.any() else 0.0,
            "kept_scale": float(reference[kept_fully].abs().max()) if kept_fully.any() else 0.0,
        }
    )


def all_to_all_bytes(counter):
    return [c.tensor_bytes for c in counter.calls if c.op == "all_to_all"]


counts, dropped, _ = ep.take_step_stats()
record = {
    "rank": rank,
    "layers": layers,
    "forward_a2a": all_to_all_bytes(forward_count),
    "backward_a2a": all_to_all_bytes(backward_count),
    "hidden": hidden,
    "top_k": k,
    "element_bytes": 4,
    "num_experts": E,
    "step_counts": counts.tolist(),
    "step_dropped": int(dropped),
}
records = [None] * world
dist.all_gather_object(records, record)
if rank == 0:
    Path(args.out).write_text(json.dumps(records))
leave_process_group()

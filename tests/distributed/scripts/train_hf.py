"""A Hugging Face model (built from a small config) trained under FiveDStrategy.

Rank 0 writes the per-step losses (averaged over data ranks) and the full parameters.
"""

import argparse
import json
import os
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

import lightning_5d
from hf_support import CausalLM
from tests_support import RecordReturned, make_datamodule

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True, choices=["llama", "qwen2", "gpt2", "mixtral", "qwen2_moe"])
parser.add_argument("--tp", type=int, default=1)
parser.add_argument("--sp", action="store_true")
parser.add_argument("--cp", type=int, default=1)
parser.add_argument("--cp-mode", default="ring", choices=["ring", "allgather", "alltoall"])
parser.add_argument("--zero", type=int, default=1)
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--pp", type=int, default=1)
parser.add_argument("--ep", type=int, default=1)
parser.add_argument("--capacity-factor", type=float, default=None)
parser.add_argument("--schedule", default="1f1b")
parser.add_argument("--virtual-stages", type=int, default=1)
parser.add_argument("--microbatches", type=int, default=None)
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=None)
parser.add_argument("--precision", default="32-true")
parser.add_argument("--out", required=True)
args = parser.parse_args()

L.seed_everything(0)
module = CausalLM(args.model, args.layers)
strategy = lightning_5d.FiveDStrategy(
    tp=args.tp, cp=args.cp, context={"mode": args.cp_mode}, sequence_parallel=args.sp, zero=args.zero,
    bucket_size_mb=0.05, pp=args.pp, ep=args.ep, expert={"capacity_factor": args.capacity_factor},
    pipeline={"schedule": args.schedule, "virtual_stages": args.virtual_stages, "microbatches": args.microbatches},
)


returned = RecordReturned()
trainer = L.Trainer(
    accelerator="cpu",
    strategy=strategy,
    devices=int(os.environ["WORLD_SIZE"]),
    precision=args.precision,
    max_steps=args.steps,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    limit_val_batches=0,
    callbacks=[returned],
)
trainer.fit(module, datamodule=make_datamodule(**({"batch_size": args.batch_size} if args.batch_size else {})))
# Ring attention is the model's implementation during steps only; after fit it has its own back.
assert module.model.config._attn_implementation != "lightning_5d_ring", module.model.config._attn_implementation
losses = torch.stack(module.losses if args.pp == 1 else returned.losses)
dist.all_reduce(losses, group=strategy.mesh.group("dp"))
losses /= strategy.mesh.data_size
state = strategy.full_model_state()
if dist.get_rank() == 0:
    out = Path(args.out)
    torch.save({k: v.detach().clone() for k, v in state.items()}, out / "params.pt")
    (out / "result.json").write_text(json.dumps({"losses": losses.tolist()}))

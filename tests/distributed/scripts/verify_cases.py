"""Several Trainer.fit runs in one launch, each checked by the plan verifier at setup.

``--cases a,b,...`` names entries of CASES. A case expected to pass trains one step; a case
with a broken plan must stop in setup with PlanVerificationError before any training step
(the module counts the steps that started). Rank 0 writes one JSON line per case
to ``--out``: the outcome, the error text, and whether a training step ran.
"""

import argparse
import json
import os
from pathlib import Path

import lightning as L
import torch

import lightning_5d
from lightning_5d.verify import PlanVerificationError
from tests_support import make_datamodule
from verify_models import FusedGateUpLM, InterleavedQKVLM, MarkedLM, ScaledEmbeddingLM

# name -> (module class, FiveDStrategy keyword arguments, expected outcome)
CASES = {
    "tp2": (MarkedLM, {"tp": 2}, "pass"),
    "tp2_sp": (MarkedLM, {"tp": 2, "sequence_parallel": True}, "pass"),
    "zero3": (MarkedLM, {"zero": 3}, "pass"),
    "cp2": (MarkedLM, {"cp": 2}, "pass"),
    "pp2": (MarkedLM, {"pp": 2, "pipeline": {"microbatches": 2}}, "pass"),
    "scaled_embedding_tp2": (ScaledEmbeddingLM, {"tp": 2}, "fail"),
    "scaled_embedding_tp2_sp": (ScaledEmbeddingLM, {"tp": 2, "sequence_parallel": True}, "fail"),
    "fused_gate_up_tp2": (FusedGateUpLM, {"tp": 2, "model_plan": FusedGateUpLM.PLAN}, "fail"),
    "interleaved_qkv_tp2": (InterleavedQKVLM, {"tp": 2}, "fail"),  # discovery's own plan reads [q|k|v]
    "fused_gate_up_tp2_off": (FusedGateUpLM, {"tp": 2, "model_plan": FusedGateUpLM.PLAN, "verify": "off"}, "pass"),
    "scaled_embedding_cp2": (ScaledEmbeddingLM, {"cp": 2}, "pass"),  # cp keeps the subclass's forward
}

parser = argparse.ArgumentParser()
parser.add_argument("--cases", required=True)
parser.add_argument("--out", required=True)
args = parser.parse_args()

rank = int(os.environ.get("RANK", "0"))
lines = []
for name in args.cases.split(","):
    cls, kwargs, expected = CASES[name]
    torch.manual_seed(0)
    module = cls()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=lightning_5d.FiveDStrategy(**kwargs),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    outcome, error = "pass", ""
    try:
        trainer.fit(module, datamodule=make_datamodule())
    except PlanVerificationError as err:
        outcome, error = "fail", str(err)
    lines.append(
        {"case": name, "expected": expected, "outcome": outcome, "error": error, "steps": module.steps_started}
    )
    print(f"CASE {name}: {outcome}", flush=True)
if rank == 0:
    Path(args.out).write_text("\n".join(json.dumps(line) for line in lines) + "\n")

from lightning_5d.testing import leave_process_group  # noqa: E402

leave_process_group()

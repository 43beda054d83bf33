"""Several Trainer.fit runs in one launch, each checked by the plan verifier at setup.

``--cases a,b,...`` names entries of CASES. A case expected to pass trains one step; a case
with a broken plan must stop in setup with PlanVerificationError before any training step
(the module counts the steps that started). Rank 0 writes one JSON line per case
to ``--out``: the outcome, the error text, whether a training step ran, and what this
rank's check compared (pieces, gradients) and left out.
"""

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

import lightning as L
import torch

import lightning_5d
from lightning_5d.plan import observe as observation
from lightning_5d.plan.model_plan import ColumnLayout
from lightning_5d.verify import PlanCheck, PlanVerificationError, ProbeError
from tests_support import make_datamodule
from lightning_5d.parallel.tensor.sharding import TensorParallel
from verify_models import FusedGateUpLM, HeadNormLM, InterleavedQKVLM, MarkedLM, NestedLM, ScaledEmbeddingLM

# name -> (module class, FiveDStrategy keyword arguments, expected outcome)
CASES = {
    "tp2": (MarkedLM, {"tp": 2}, "pass"),
    "tp2_sp": (MarkedLM, {"tp": 2, "sequence_parallel": True}, "pass"),
    "zero3": (MarkedLM, {"zero": 3, "verify": "blocks"}, "pass"),  # not checked by the default (auto)
    "cp2": (MarkedLM, {"cp": 2}, "pass"),
    "pp2": (MarkedLM, {"pp": 2, "pipeline": {"microbatches": 2}}, "pass"),
    # Fixed in discovery and tensor parallelism; the verifier confirms the fixes.
    "scaled_embedding_tp2": (ScaledEmbeddingLM, {"tp": 2}, "pass"),
    "scaled_embedding_tp2_sp": (ScaledEmbeddingLM, {"tp": 2, "sequence_parallel": True}, "pass"),
    "fused_gate_up_tp2": (FusedGateUpLM, {"tp": 2, "model_plan": FusedGateUpLM.PLAN}, "pass"),
    "interleaved_qkv_tp2": (InterleavedQKVLM, {"tp": 2}, "pass"),
    "scaled_embedding_cp2": (ScaledEmbeddingLM, {"cp": 2}, "pass"),  # cp keeps the subclass's forward
    "head_norm_tp2": (HeadNormLM, {"tp": 2}, "pass"),  # per-head q/k norms: gradients summed over tp
    # Broken on purpose (the plans these models got before discovery observed the forward):
    # "_guessed" skips the probe, so the per-head interleaved qkv is read as [q|k|v] side by
    # side; "_cut_plain" declares [gate|up] one plain tensor, cut into contiguous halves.
    # The verifier must stop setup.
    "interleaved_qkv_tp2_guessed": (InterleavedQKVLM, {"tp": 2}, "fail"),
    "fused_gate_up_tp2_cut_plain": (FusedGateUpLM, {"tp": 2, "model_plan": FusedGateUpLM.PLAN}, "fail"),
    "fused_gate_up_tp2_cut_plain_off": (
        FusedGateUpLM, {"tp": 2, "model_plan": FusedGateUpLM.PLAN, "verify": "off"}, "pass"
    ),  # fmt: skip
    # The per-head q/k norms' gradients left as this rank's part (tp's sum over its ranks skipped):
    # the forward is exact, only the gradients are wrong; the verifier's backward must stop setup.
    "head_norm_tp2_unsummed": (HeadNormLM, {"tp": 2}, "fail"),
    # The probe's forward fails on the first pipeline stage only (its block 0 raises, as nanoGPT's
    # attention did under tp x pp): the other stage's rank must stop with the same refusal, not
    # wait for an activation (it died of a gloo connection reset before).
    "pp2_refused_on_stage0": (MarkedLM, {"pp": 2, "pipeline": {"microbatches": 2}}, "refused"),
    # Gradients under ZeRO-3 (each unit gathered for its piece's backward) and under activation
    # checkpointing (the recomputation inside the probe's context; cp's ring attention needs it).
    "head_norm_tp2_zero3": (HeadNormLM, {"tp": 2, "zero": 3}, "pass"),
    "head_norm_tp2_zero3_unsummed": (HeadNormLM, {"tp": 2, "zero": 3}, "fail"),
    "cp2_zero3": (MarkedLM, {"cp": 2, "zero": 3}, "pass"),  # FSDP2 shards over the 2 cp ranks
    "tp2_sp_zero3": (MarkedLM, {"tp": 2, "sequence_parallel": True, "zero": 3}, "pass"),  # SP's norms summed over tp
    "pp2_zero3": (MarkedLM, {"pp": 2, "zero": 3, "pipeline": {"microbatches": 2}}, "pass"),
    "cp2_ac": (MarkedLM, {"cp": 2, "activation_checkpointing": "full"}, "pass"),
    "head_norm_tp2_ac_unsummed": (HeadNormLM, {"tp": 2, "activation_checkpointing": "selective"}, "fail"),
    # Container blocks (for attn, ff in layers): each sub-layer compared as a piece of its own.
    "nested_tp2": (NestedLM, {"tp": 2, "model_plan": NestedLM.PLAN}, "pass"),
    "nested_tp2_zero3": (NestedLM, {"tp": 2, "zero": 3, "model_plan": NestedLM.PLAN}, "pass"),
    "nested_cp2_zero3": (NestedLM, {"cp": 2, "zero": 3, "model_plan": NestedLM.PLAN}, "pass"),
    "nested_tp2_cut_plain": (NestedLM, {"tp": 2, "model_plan": NestedLM.PLAN}, "fail"),
    # A column-parallel weight's gradient doubled on tp rank 1 only (a broken hook on a cut
    # parameter): outputs exact, rank 0's own shard right; the shards' sums over tp must name it.
    "q_proj_grad_doubled_on_rank1_tp2": (MarkedLM, {"tp": 2}, "fail"),
}


def guessed(root, plan, probe=None):
    """Discovery's observation step, skipped: the plan keeps its name-and-shape guesses."""
    return plan


def cut_plain(root, plan, *probe):
    """Every fused projection declared one plain tensor after observation: cut contiguously."""
    plan = real_observe(root, plan, *probe)
    blocks = []
    for block in plan.block_plans:
        if block.mlp is not None and block.mlp.column[0].layout is not ColumnLayout.PLAIN:
            plain = replace(block.mlp.column[0], segments=(), layout=ColumnLayout.PLAIN)
            block = replace(block, mlp=replace(block.mlp, column=(plain, *block.mlp.column[1:])))
        blocks.append(block)
    return replace(plan, block_plans=tuple(blocks))


SABOTAGE = {"_guessed": guessed, "_cut_plain": cut_plain}

parser = argparse.ArgumentParser()
parser.add_argument("--cases", required=True)
parser.add_argument("--out", required=True)
args = parser.parse_args()

rank = int(os.environ.get("RANK", "0"))
real_observe = observation.observe
real_mark_head_partial = TensorParallel._mark_head_partial


def unsummed(self, block, prefix, block_plan):
    """tp's mark of the per-head norms' partial gradients, skipped: no sum over tp."""


real_tp_init = TensorParallel.__init__


def doubling_on_rank1(self, root, *args, **kwargs):
    """tp applied, then block 0's q_proj weight (cut by columns) given a gradient hook that
    doubles it on tp rank 1."""
    real_tp_init(self, root, *args, **kwargs)
    weight = dict(root.named_parameters())["model.layers.0.attention.q_proj.weight"]
    if self.rank == 1:
        weight.register_hook(lambda grad: grad * 2)


real_after = PlanCheck.after
checked = []  # the report of this rank's check in the current case


def reporting(self, module, **kwargs):
    checked.append(real_after(self, module, **kwargs))
    return checked[-1]


first_block = []  # block 0 as built (under pp the stage's container no longer holds it on every rank)


def refusing_block0(self, module, **kwargs):
    """The verifier's probe, with block 0 raising (discovery, before it, ran the block unchanged)."""
    block = first_block[0]

    def refuse(*a, **k):
        raise ValueError("block 0 cannot run this probe (test sabotage)")

    block.forward = refuse
    try:
        return reporting(self, module, **kwargs)
    finally:
        del block.forward


lines = []
for name in args.cases.split(","):
    cls, kwargs, expected = CASES[name]
    observation.observe = next((f for tag, f in SABOTAGE.items() if tag in name), real_observe)
    TensorParallel._mark_head_partial = unsummed if "_unsummed" in name else real_mark_head_partial
    TensorParallel.__init__ = doubling_on_rank1 if "_doubled_on_rank1" in name else real_tp_init
    PlanCheck.after = refusing_block0 if "_refused_on_stage0" in name else reporting
    checked.clear()
    torch.manual_seed(0)
    module = cls()
    first_block[:] = [module.model.layers[0] if hasattr(module, "model") else module.layers[0]]
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
    except ProbeError as err:
        outcome, error = "refused", str(err)
    report = checked[0] if checked else None  # None: setup stopped inside the check
    compared = {r.name: [g for g, _ in r.grads] for r in report.results} if report is not None else {}
    lines.append({"case": name, "expected": expected, "outcome": outcome, "error": error,
                  "steps": module.steps_started, "compared": compared,
                  "skipped": report.skipped if report is not None else []})  # fmt: skip
    print(f"CASE {name}: {outcome}", flush=True)
# Every rank's outcomes: a refusal must reach each rank with the same message.
out = Path(args.out) if rank == 0 else Path(f"{args.out}.rank{rank}")
out.write_text("\n".join(json.dumps(line) for line in lines) + "\n")

from lightning_5d.testing import leave_process_group  # noqa: E402

leave_process_group()

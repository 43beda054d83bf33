"""What a user's gradient hooks compute, under a layout, against one process.

    gradient_hooks.py --cases JSON --out FILE

Each case trains the reference model (seed 0; ``tiny_moe`` with its MoE blocks) for 2 steps with one Trainer and
FiveDStrategy(**layout) (a world of one: one process), with a hook written as for one process:

* ``lightning_grad_norm``: ``self.log_dict(grad_norm(self, 2))`` (Lightning's utility);
* ``torch_clip``: ``torch.nn.utils.clip_grad_norm_(self.parameters(), 0.05)``;
* ``l5d_grad_norm``: ``self.log_dict(lightning_5d.grad_norm(self, norm))``, also of one block;
  ``l5d_grad_norm_after_backward``: the same in ``on_after_backward``; ``norm_weight_after_backward``:
  a norm weight's gradient norm there; ``norm_before_zero_grad``: the total norm in ``on_before_zero_grad``;
* ``value_clip``: ``torch.nn.utils.clip_grad_value_(self.parameters(), 1e-3)`` (element-wise);
* ``trainer_clip``: no hook, ``Trainer(gradient_clip_val=0.05)``;
* ``manual_torch_clip`` / ``manual_lightning_clip``: manual optimization, clipping between
  ``self.manual_backward(loss)`` and ``opt.step()`` with torch's ``clip_grad_norm_`` or
  ``self.clip_gradients(opt, 0.05, "norm")``; ``manual_accumulate``: the latter every 2 batches.

Rank 0 writes, per case, the logged metrics and the final full parameters, or the error that
stopped the fit (tests/distributed/test_gradient_hooks.py).
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.utilities import grad_norm  # noqa: E402

import lightning_5d  # noqa: E402
from tests_support import MODELS, RecordingLM, make_datamodule, run_cases_and_leave  # noqa: E402

STEPS = 2


class HookedLM(RecordingLM):
    hook = "none"
    norm = 2.0

    def on_after_backward(self):
        if self.hook == "l5d_grad_norm_after_backward":  # SP's norm weights: partial sums until later
            self.log_dict(lightning_5d.grad_norm(self, self.norm))
        elif self.hook == "norm_weight_after_backward":
            self.log("norm_weight", self.model.layers[0].attention_norm.weight.grad.norm())

    def on_before_zero_grad(self, optimizer):
        if self.hook == "norm_before_zero_grad" and self.trainer.global_step > 0:  # a stepped gradient
            norms = [p.grad.norm() for p in self.parameters() if p.grad is not None]
            self.log("previous_norm", torch.stack(norms).norm())

    def on_before_optimizer_step(self, optimizer):
        if self.hook == "lightning_grad_norm":
            self.log_dict(grad_norm(self, norm_type=2))
        elif self.hook == "torch_clip":
            self.log("total_norm", torch.nn.utils.clip_grad_norm_(self.parameters(), 0.05))
        elif self.hook == "l5d_grad_norm":
            self.log_dict(lightning_5d.grad_norm(self, self.norm))
            block = lightning_5d.grad_norm(self, self.norm, group_separator=":", module="model.layers.1")
            self.log_dict({f"last_block/{k}": v for k, v in block.items()})
        elif self.hook == "value_clip":
            torch.nn.utils.clip_grad_value_(self.parameters(), 1e-3)


class ManualLM(HookedLM):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False
        self.mode_stack_depths = []  # torch's function-mode stack as each step starts: must not grow

    def training_step(self, batch, batch_idx):
        self.mode_stack_depths.append(len(torch.overrides._get_current_function_mode_stack()))
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        if self.hook == "manual_accumulate" and batch_idx % 2 == 0:
            return loss  # gradients of 2 batches per optimizer step: the step ends inside the window
        if self.hook == "manual_torch_clip":
            self.log("total_norm", torch.nn.utils.clip_grad_norm_(self.parameters(), 0.05))
        else:
            self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        opt.step()
        opt.zero_grad()
        return loss


def run(case: dict) -> dict:
    L.seed_everything(0, verbose=False)
    module = (ManualLM if case["hook"].startswith("manual_") else HookedLM)(config=MODELS[case.get("model", "tiny")])
    module.hook, module.norm = case["hook"], float(case.get("norm", 2.0))
    world = int(os.environ["WORLD_SIZE"])
    trainer = L.Trainer(accelerator="cpu", strategy=lightning_5d.FiveDStrategy(**case["layout"]), devices=world,
                        precision=case.get("precision", "32-true"), max_steps=case.get("steps", STEPS), logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0,
                        gradient_clip_val=0.05 if case["hook"] == "trainer_clip" else None)  # fmt: skip
    try:
        trainer.fit(module, datamodule=make_datamodule(batch_size=case.get("batch", 2)))
    except lightning_5d.GradientReadError as error:
        return {"error": str(error)}
    state = trainer.strategy.full_model_state()
    return {"metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "params": {k: v.detach().clone() for k, v in state.items()},
            "mode_stack_depths": getattr(module, "mode_stack_depths", []),
            "mode_stack_after": len(torch.overrides._get_current_function_mode_stack())}  # fmt: skip


if __name__ == "__main__":
    run_cases_and_leave(run)

"""Lightning's weight averaging and a module's checkpoint hooks through a save and a resume, against one process.

    checkpoint_hooks.py --cases JSON --out FILE

Each case trains the reference model (seed 0) for 2 steps with FiveDStrategy(**layout) (a world of
one: one process), validating after every step and saving at step 2 (sharded format), then a
new module and Trainer resume from that checkpoint to step 4. ``hook``:

* ``ema``: Lightning's ``WeightAveraging`` with an EMA (decay 0.5): validation swaps the averaged
  weights in and out, the checkpoint holds the averaged model as ``state_dict`` and the current
  one beside it, and the resume rebuilds both from ``checkpoint["state_dict"]``;
* ``renamed``: the module's ``on_save_checkpoint`` stores every key under ``v1.`` and its
  ``on_load_checkpoint`` renames them back by replacing ``checkpoint["state_dict"]`` (a
  checkpoint written by an older version of the module);
* ``inspect``: the module's ``on_load_checkpoint`` reads one stored tensor (its norm) on rank 0 only.

Rank 0 writes, per case, the final full parameters and what the load hook saw, or the error
that stopped the run (tests/distributed/test_checkpoint_hooks.py).
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint, WeightAveraging  # noqa: E402
from torch.optim.swa_utils import get_ema_avg_fn  # noqa: E402

import lightning_5d  # noqa: E402
from tests_support import MODELS, RecordingLM, make_datamodule, run_cases_and_leave  # noqa: E402


class HookedLM(RecordingLM):
    hook = "none"
    seen: dict = {}

    def on_save_checkpoint(self, checkpoint):
        if self.hook == "renamed":
            checkpoint["state_dict"] = {f"v1.{k}": v for k, v in checkpoint["state_dict"].items()}

    def on_load_checkpoint(self, checkpoint):
        if self.hook == "renamed":
            checkpoint["state_dict"] = {k.removeprefix("v1."): v for k, v in checkpoint["state_dict"].items()}
        elif self.hook == "inspect" and self.global_rank == 0:  # one rank alone: no collective may hang
            self.seen = {"keys": len(checkpoint["state_dict"]),
                         "norm": float(checkpoint["state_dict"]["model.norm.weight"].norm())}  # fmt: skip


def trainer_for(case: dict, steps: int, root: str) -> L.Trainer:
    callbacks = [ModelCheckpoint(dirpath=root, save_last=True, every_n_train_steps=2)]
    if case["hook"] == "ema":
        callbacks.append(WeightAveraging(avg_fn=get_ema_avg_fn(decay=0.5)))
    return L.Trainer(accelerator="cpu", strategy=lightning_5d.FiveDStrategy(**case["layout"]),
                     devices=int(os.environ["WORLD_SIZE"]), max_steps=steps, logger=False, default_root_dir=root,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     limit_val_batches=1, val_check_interval=1, callbacks=callbacks)  # fmt: skip


def module_for(case: dict, seed: int) -> HookedLM:
    L.seed_everything(seed, verbose=False)
    module = HookedLM(config=MODELS["tiny"])
    module.hook = case["hook"]
    return module


def run(case: dict) -> dict:
    root = case["root"]
    data = lambda: make_datamodule(batch_size=case.get("batch", 2))  # noqa: E731
    try:
        trainer_for(case, 2, root).fit(module_for(case, 0), datamodule=data())
        module = module_for(case, 1)  # other initial weights: the resume must bring the saved ones
        trainer = trainer_for(case, 4, root)
        trainer.fit(module, datamodule=data(), ckpt_path=os.path.join(root, "last.ckpt"))
    except lightning_5d.ParameterReadError as error:
        return {"error": f"{type(error).__name__}: {error}"}
    state = trainer.strategy.full_model_state()
    return {"params": {k: v.detach().clone() for k, v in state.items()}, "seen": module.seen}


if __name__ == "__main__":
    run_cases_and_leave(run)

"""Lightning's ``BackboneFinetuning`` under FiveDStrategy: the reference model's blocks as the
backbone, frozen until epoch 1, then added to the optimizer as a new parameter group.

    backbone_finetuning.py --zero 1,3 --batch-size B --out FILE

One case per ZeRO stage, in one launch; rank 0 writes each case's error (a refusal) or its
trained full parameters (tests/distributed/test_frozen_parameters.py).
"""

import argparse
import os

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import BackboneFinetuning

import lightning_5d
from lightning_5d.parallel.frozen import FrozenParameterError
from lightning_5d.testing import leave_process_group
from tests_support import MODELS, RecordingLM, make_datamodule


class BackboneLM(RecordingLM):
    @property
    def backbone(self):
        return self.model.layers


def run(zero: int, batch_size: int) -> dict:
    L.seed_everything(0, verbose=False)
    model = BackboneLM(config=MODELS["tiny"])
    unfreeze = BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.0,
                                  backbone_initial_ratio_lr=0.1, verbose=False)  # fmt: skip
    strategy = lightning_5d.FiveDStrategy(zero=zero, bucket_size_mb=0.05)
    trainer = L.Trainer(accelerator="cpu", strategy=strategy, devices=int(os.environ["WORLD_SIZE"]),
                        precision="32-true", max_epochs=2, limit_train_batches=2, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[unfreeze])  # fmt: skip
    try:
        trainer.fit(model, datamodule=make_datamodule(num_samples=64, batch_size=batch_size))
    except FrozenParameterError as error:
        return {"error": str(error)}
    return {"params": {k: v.detach().clone() for k, v in strategy.full_model_state().items()}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--zero", required=True, help="comma-separated ZeRO stages, one case each")
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results = {int(z): run(int(z), args.batch_size) for z in args.zero.split(",")}
    if dist.get_rank() == 0:
        torch.save(results, args.out)
    leave_process_group()


if __name__ == "__main__":
    main()

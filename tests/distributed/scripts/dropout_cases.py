"""nanoGPT (tests/zoo) with dropout 0.1 (attention and residual) under tp, several cases in one launch.

    dropout_cases.py --cases JSON --out FILE

Each case trains the model from seed 0 under ``FiveDStrategy(**case["strategy"])`` (built on meta
where ``case["meta"]``; with a callback drawing on rank 0 only before every step where
``case["sample_on_rank_zero"]``) for ``case["steps"]`` steps; rank 0 writes, per case, every rank's
per-step losses, norm parameters and realigned streams, and the full trained parameters (tests/distributed/parallel/tensor/test_dropout.py).
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the zoo package

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import lightning_5d  # noqa: E402
from tests_support import make_datamodule, run_cases_and_leave  # noqa: E402
from zoo.adapter import FirstOfPair  # noqa: E402
from zoo.nanogpt import GPT, GPTConfig  # noqa: E402


class SampleOnRankZero(L.Callback):
    """Draws from the global generator on rank 0 only before every step (as code choosing
    examples to log does)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.is_global_zero:
            torch.randint(0, 100, (3,))


def run(case: dict) -> dict:
    L.seed_everything(0, verbose=False)
    strategy = lightning_5d.FiveDStrategy(bucket_size_mb=0.05, **case["strategy"])
    trainer = L.Trainer(accelerator="cpu", strategy=strategy, devices=int(os.environ["WORLD_SIZE"]),
                        precision="32-true", max_steps=case["steps"], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[SampleOnRankZero()] if case["sample_on_rank_zero"] else [])  # fmt: skip
    config = GPTConfig(dropout=case["dropout"])
    if case["meta"]:
        with trainer.init_module(empty_init=True):
            module = FirstOfPair(GPT(config))
    else:
        module = FirstOfPair(GPT(config))
    trainer.fit(module, datamodule=make_datamodule(batch_size=2))
    # The parameters tp replicates (the norms), as each rank holds them: equal if every rank drew
    # the replicated activations' masks as its peers did.
    norms = {name: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
             for name, p in module.named_parameters() if ".ln_" in name}  # fmt: skip
    per_rank = [None] * dist.get_world_size()
    realigned = strategy.dimensions.tp.random_stream.realigned
    dist.all_gather_object(per_rank, {"losses": [float(x) for x in module.losses], "norms": norms,
                                      "realigned": realigned})  # fmt: skip
    state = {k: v.detach().clone() for k, v in strategy.full_model_state().items()}
    return {key: [r[key] for r in per_rank] for key in ("losses", "norms", "realigned")} | {"params": state}


if __name__ == "__main__":
    run_cases_and_leave(run)

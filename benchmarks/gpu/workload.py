"""What every part trains: the model, its data, the sizes (full on a GPU, tiny for ``--dry``), the Trainer.

The full model has TinyLlama-1.1B's shape (1.10 B parameters with a 32,000-token vocabulary; the
byte-level corpus uses the first 256 ids, which changes nothing about the cost). Every model is
built from the same seed directly on the device, so the runs a part compares start from the same
weights and see the same batches.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SEED = 0

MODEL_1B = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_layers": 22, "num_heads": 32,
            "num_kv_heads": 4}  # fmt: skip
# One block: every FP8 GEMM is a torch._scaled_mm call, and on CPU each costs tens of milliseconds.
MODEL_TINY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_layers": 1, "num_heads": 4,
              "num_kv_heads": 2}  # fmt: skip


@dataclass(frozen=True)
class Sizes:
    """Everything a run's cost depends on. ``budgets``: seconds per part (the suite caps them to its total)."""

    mode: str  # "full" or "dry"
    model: dict[str, int]
    lr: float  # 3e-4: the reference module's 3e-3 is a tiny-model rate and diverges a 1B model
    seq: int
    batch: int
    warmup: int  # steps excluded from every timing
    segment_steps: int  # overhead: timed steps per segment of each loop
    rounds: int  # overhead: alternations (at most; the budget may end it earlier)
    fp8_steps: int  # fp8: timed steps per run (the loss is compared after warmup + fp8_steps steps)
    fp8_rounds: int  # fp8: passes over bf16 and every recipe, order rotating
    loss_window: int  # fp8: the loss compared is the mean of the last this-many steps
    attention_lengths: tuple[int, ...]
    attention_repeats: int
    memory_steps: int  # memory: steps after the first (which creates the optimizer states)
    budgets: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_step(self) -> int:
        return self.seq * self.batch

    def llama_config(self) -> dict[str, int]:
        return {**self.model, "max_seq_len": self.seq}

    def replace(self, **changes: Any) -> "Sizes":
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FULL = Sizes(
    mode="full", model=MODEL_1B, lr=3e-4, seq=2048, batch=4, warmup=3, segment_steps=8, rounds=6, fp8_steps=10,
    fp8_rounds=2, loss_window=5, attention_lengths=(4096, 8192, 16384, 32768), attention_repeats=3, memory_steps=3,
    budgets={"overhead": 110.0, "fp8": 170.0, "attention": 60.0, "memory": 45.0},
)  # fmt: skip
# Every step of every part, as few times as that allows; budgets that never cut a dry run short.
DRY = Sizes(
    mode="dry", model=MODEL_TINY, lr=3e-3, seq=32, batch=2, warmup=1, segment_steps=1, rounds=2, fp8_steps=1,
    fp8_rounds=1, loss_window=1, attention_lengths=(32, 64), attention_repeats=1, memory_steps=1,
    budgets={"overhead": 300.0, "fp8": 300.0, "attention": 300.0, "memory": 300.0},
)  # fmt: skip


def build_module(sizes: Sizes, device: torch.device):
    """The reference ``LlamaLM``, seeded, its weights created on ``device`` (no host copy of 1B weights)."""
    import lightning as L

    from lightning_5d.models import LlamaConfig, LlamaLM

    L.seed_everything(SEED, verbose=False)
    with torch.device(device):
        return LlamaLM(LlamaConfig(**sizes.llama_config()), lr=sizes.lr)


def build_data(sizes: Sizes, steps: int):
    """``steps`` batches of ``batch`` sequences of ``seq`` tokens, in one epoch."""
    from lightning_5d.models import TextDataModule

    return TextDataModule(seq_len=sizes.seq, batch_size=sizes.batch, num_samples=sizes.batch * steps, val_samples=1)


def make_trainer(device: torch.device, max_steps: int, callbacks: list, fp8_recipe: str | None = None):
    """``Trainer(strategy=FiveDStrategy(), precision="bf16-mixed")`` as a user writes it (the planner picks
    the layout: on one GPU, plain data parallelism of one), or with our FP8 backend for ``fp8_recipe``."""
    import lightning as L

    from lightning_5d import FiveDPrecision, FiveDStrategy

    if fp8_recipe is None:
        precision: dict[str, Any] = {"precision": "bf16-mixed"}
    else:  # the torch-native backend: torch._scaled_mm, not Transformer Engine, is what is measured
        precision = {"plugins": [FiveDPrecision("fp8", recipe=fp8_recipe, fp8={"backend": "torch"})]}
    return L.Trainer(
        accelerator=device.type, devices=1, strategy=FiveDStrategy(), **precision, max_steps=max_steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0, callbacks=callbacks,
    )  # fmt: skip


def hf_config(sizes: Sizes) -> dict[str, Any]:
    """The model as a Hugging Face ``config.json``, the form ``l5d estimate --model`` reads."""
    m = sizes.llama_config()
    return {"model_type": "llama", "vocab_size": m["vocab_size"], "hidden_size": m["hidden_size"],
            "intermediate_size": m["intermediate_size"], "num_hidden_layers": m["num_layers"],
            "num_attention_heads": m["num_heads"], "num_key_value_heads": m["num_kv_heads"],
            "max_position_embeddings": m["max_seq_len"], "tie_word_embeddings": False}  # fmt: skip


def write_hf_config(sizes: Sizes, folder: Path) -> Path:
    path = folder / "model_config.json"
    path.write_text(json.dumps(hf_config(sizes), indent=2) + "\n")
    return path


def planner_estimate(sizes: Sizes):
    """The planner's view of one rank training this model, for its parameter count and model FLOPs
    (which no ZeRO stage changes): dp 1, bf16, flash attention."""
    from lightning_5d.estimate import estimate, spec_from_hf_config

    spec = spec_from_hf_config(hf_config(sizes), name=f"llama-{sizes.mode}")
    return estimate(spec, dp_shard=1, zero=0, precision="bf16", seq_len=sizes.seq, micro_batch_size=sizes.batch)


def loss_of(outputs: Any) -> torch.Tensor:
    """The step's loss from ``on_train_batch_end``'s outputs, detached, still on the device (no sync)."""
    loss = outputs["loss"] if isinstance(outputs, dict) else outputs
    return loss.detach()

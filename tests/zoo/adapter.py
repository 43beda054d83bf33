"""The one LightningModule every zoo model trains in: next-token cross entropy from the
batch's aligned labels, AdamW, and a record of each training_step's loss.

A model that holds its parameters on the LightningModule itself subclasses :class:`ZooLM`
and defines ``logits``; a plain ``nn.Module`` is wrapped by one of the small subclasses
below, which differ only in how they call the model (as the model's own code expects).
"""

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn


class ZooLM(L.LightningModule):
    """The loss the obvious ``training_step`` computes; a subclass defines
    ``logits(input_ids) -> [batch, seq, vocab]`` (how its model is called)."""

    def __init__(self):
        super().__init__()
        self.losses: list[torch.Tensor] = []

    def compute_loss(self, batch: dict) -> torch.Tensor:
        logits = self.logits(batch["input_ids"])
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch["labels"].reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self.compute_loss(batch)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.0)


class Positional(ZooLM):
    """``self.model(input_ids)`` returns the logits."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def logits(self, input_ids):
        return self.model(input_ids)


class FirstOfPair(Positional):
    """nanoGPT's convention: ``logits, loss = model(idx)``."""

    def logits(self, input_ids):
        logits, _ = self.model(input_ids)
        return logits


class Keyword(Positional):
    """The model's forward takes keyword-only arguments: ``model(input_ids=...)``."""

    def logits(self, input_ids):
        return self.model(input_ids=input_ids)


class HuggingFace(Positional):
    """A Hugging Face ``*ForCausalLM``: ``model(input_ids=...).logits``."""

    def logits(self, input_ids):
        return self.model(input_ids=input_ids).logits

"""Models and batches context parallelism must handle or refuse, under FiveDStrategy(cp=2).

--case rope_cache     a model whose rotary module slices a cos/sin cache by sequence length
                      (no position_ids anywhere): trains 3 steps; rank 0 compares the losses
                      and parameters with one process and writes result.json to --out.
--case manual         the rope_cache model under manual optimization: two forward/backward
                      passes per step and a self.log after each backward; compared as rope_cache.
--case hf_two_models  a Hugging Face policy and a frozen Hugging Face reference model (as in
                      DPO or distillation): inside the step the reference's logits on the shard
                      must equal its full-sequence logits (computed before the step) at the
                      shard's positions; prints REFERENCE MATCHES.
--case hf_positional_mask  a Hugging Face model called with a padding mask passed
                      positionally: fails at the first step.
--case hidden_cache   the rope_cache model with the length slice inside its rotary module (called
                      with the hidden states, no seq_len): the probe observes the cache read
                      as its first n rows, cp hands the shard its rows; compared as rope_cache.
--case no_positions   rotary angles from positions counted by cumsum in the forward: fails in setup.
--case explicit_softmax  attention spelled out as softmax(QK^T)V: fails in setup.
--case unlabelled     batches of input_ids only (the module shifts them itself): fails at
                      the first step, before any optimizer step.
--case bad_seq        sequence length 30 with cp=2 (zig-zag needs a multiple of 4): fails at
                      the first step.
Every failing case prints nothing from an optimizer step ("OPTIMIZER STEP RAN").
"""

import argparse
import json
import math
import os
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, default_collate

import lightning_5d
from lightning_5d.testing import leave_process_group
from lightning_5d.models.llama import Attention, RMSNorm, SwiGLUMLP
from tests_support import TINY, RecordingLM, make_datamodule

parser = argparse.ArgumentParser()
parser.add_argument("--case", required=True,
                    choices=["rope_cache", "manual", "hf_two_models", "hf_positional_mask", "no_positions", "hidden_cache",
                             "explicit_softmax", "unlabelled", "bad_seq"])  # fmt: skip
parser.add_argument("--out", default=None)
args = parser.parse_args()

H, HEADS, LAYERS, VOCAB = 64, 4, 2, 256


class RotaryEmbedding(nn.Module):
    """cos/sin computed once for max_len positions; forward returns the first seq_len rows."""

    def __init__(self, head_dim: int, max_len: int = 256, theta: float = 10000.0):
        super().__init__()
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        freqs = torch.outer(torch.arange(max_len).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x, seq_len):
        return self.cos_cached[:seq_len].to(x.dtype), self.sin_cached[:seq_len].to(x.dtype)


def rotate(x, cos, sin):  # x [b, s, h, d]; cos/sin [s, d]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[None, :, None] + torch.cat((-x2, x1), dim=-1) * sin[None, :, None]


class CacheAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_heads, self.head_dim = HEADS, H // HEADS
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(H, H, bias=False) for _ in range(4))

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class CacheBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.mlp_norm = RMSNorm(H), RMSNorm(H)
        self.attention, self.mlp = CacheAttention(), SwiGLUMLP(H, 2 * H)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class CacheModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, H)
        self.rotary = RotaryEmbedding(H // HEADS)
        self.layers = nn.ModuleList(CacheBlock() for _ in range(LAYERS))
        self.norm = RMSNorm(H)
        self.lm_head = nn.Linear(H, VOCAB, bias=False)

    def forward(self, input_ids):
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary(h, seq_len=input_ids.size(1))
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.lm_head(self.norm(h))


class Rope(RotaryEmbedding):
    """Same cache, but called with the positions it computes itself: nothing to reach."""

    def forward(self, x):
        return self.cos_cached[: x.size(1)], self.sin_cached[: x.size(1)]


class InlineRope(nn.Module):
    """cos/sin from positions counted with ``cumsum`` inside the forward: positions nothing can
    reach (an ``arange`` there is observed by its call site, plan/position_aranges.py; a running
    count is not)."""

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta

    def forward(self, x):
        inv = 1.0 / self.theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        positions = torch.ones(x.size(1)).cumsum(0) - 1
        emb = torch.outer(positions, inv).repeat(1, 2)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class HiddenPositionsModel(CacheModel):
    def __init__(self, rotary: type[nn.Module] = Rope):
        super().__init__()
        self.rotary = rotary(H // HEADS)

    def forward(self, input_ids):
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary(h)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.lm_head(self.norm(h))


class ExplicitAttention(Attention):
    def forward(self, x, position_ids):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class LM(L.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.losses = []

    def forward(self, input_ids):
        return self.model(input_ids)

    def training_step(self, batch, batch_idx):
        logits = self(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        self.losses.append(loss.detach().clone())
        self.log("train_loss", loss)
        return loss

    def on_before_optimizer_step(self, optimizer):
        print("OPTIMIZER STEP RAN", flush=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class ManualLM(LM):
    """Each step: one row, then the other, each backpropagated (mean of the halves = the batch mean)."""

    def __init__(self, model):
        super().__init__(model)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        total = 0.0
        for rows in (slice(0, 1), slice(1, 2)):
            logits = self(batch["input_ids"][rows])
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"][rows].flatten())
            self.manual_backward(loss / 2)
            self.log("half_loss", loss)  # after a backward, still inside the step
            total = total + loss.detach() / 2
        optimizer.step()
        self.losses.append(total)


class TwoModels(LM):
    """A trained policy next to a frozen reference model, both Hugging Face Llama."""

    def __init__(self, padding_mask: bool = False):
        from hf_support import build_hf_model

        super().__init__(build_hf_model("llama"))
        self.reference = build_hf_model("llama").requires_grad_(False)
        self.padding_mask = padding_mask
        self.full_reference = None

    def on_train_batch_start(self, batch, batch_idx):
        with torch.no_grad():  # outside the step: the whole sequence, no context parallelism
            self.full_reference = self.reference(batch["input_ids"]).logits

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        if self.padding_mask:
            mask = torch.ones_like(ids)
            mask[:, 0] = 0
            self.model(ids, mask)  # attention_mask passed positionally
        with torch.no_grad():
            shard_logits = self.reference(ids).logits
        positions = self.trainer.strategy.context_parallel.current.positions
        torch.testing.assert_close(shard_logits, self.full_reference[:, positions], rtol=1e-5, atol=1e-5)
        print("REFERENCE MATCHES", flush=True)
        logits = self.model(input_ids=ids).logits
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


class Sequences(Dataset):
    def __init__(self, seq_len: int, labels: bool):
        self.seq_len, self.labels = seq_len, labels

    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, VOCAB, (self.seq_len + 1,), generator=torch.Generator().manual_seed(i))
        item = {"input_ids": ids[:-1]}
        if self.labels:
            item["labels"] = ids[1:]
        return item


class Unlabelled(RecordingLM):
    def on_before_optimizer_step(self, optimizer):
        print("OPTIMIZER STEP RAN", flush=True)


L.seed_everything(0)
data = {"datamodule": make_datamodule()}
if args.case == "rope_cache":
    module = LM(CacheModel())
elif args.case == "manual":
    module = ManualLM(CacheModel())
elif args.case in ("hf_two_models", "hf_positional_mask"):
    module = TwoModels(padding_mask=args.case == "hf_positional_mask")
elif args.case == "no_positions":
    module = LM(HiddenPositionsModel(rotary=InlineRope))
elif args.case == "hidden_cache":
    module = LM(HiddenPositionsModel())
elif args.case == "explicit_softmax":
    module = Unlabelled(config=TINY)
    for layer in module.model.layers:
        layer.attention.__class__ = ExplicitAttention
elif args.case == "unlabelled":
    module = Unlabelled(config=TINY)
    data = {"train_dataloaders": DataLoader(Sequences(32, labels=False), batch_size=2)}
else:  # bad_seq
    module = LM(CacheModel())
    data = {"train_dataloaders": DataLoader(Sequences(30, labels=True), batch_size=2)}

STEPS = 1 if args.case.startswith("hf_") else 3
trainer = L.Trainer(
    accelerator="cpu",
    devices=int(os.environ["WORLD_SIZE"]),
    strategy=lightning_5d.FiveDStrategy(cp=2, zero=1),
    max_steps=STEPS,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    limit_val_batches=0,
)
trainer.fit(module, **data)

if args.case.startswith("hf_"):
    leave_process_group()
# rope_cache, manual and hidden_cache only from here: compare with the model trained in one process.
losses = [x.item() for x in module.losses]
state = trainer.strategy.full_model_state()
if dist.get_rank() == 0:
    L.seed_everything(0, verbose=False)
    ref = LM(CacheModel())
    dm = make_datamodule()
    dm.setup("fit")
    optimizer = ref.configure_optimizers()
    perm = torch.randperm(len(dm.train_dataset), generator=torch.Generator().manual_seed(0)).tolist()
    ref_losses = []
    for step in range(STEPS):
        batch = default_collate([dm.train_dataset[i] for i in perm[2 * step : 2 * step + 2]])
        optimizer.zero_grad()
        logits = ref(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        loss.backward()
        optimizer.step()
        ref_losses.append(loss.item())
    ref_state = ref.state_dict()
    diff = sum((state[k].double() - v.double()).norm() ** 2 for k, v in ref_state.items()) ** 0.5
    total = sum(v.double().norm() ** 2 for v in ref_state.values()) ** 0.5
    Path(args.out).write_text(
        json.dumps({"losses": losses, "ref_losses": ref_losses, "param_error": float(diff / total)})
    )

leave_process_group()  # objects above still hold process groups: leave together, then exit

"""Part 1: ``Trainer(strategy=FiveDStrategy(), precision="bf16-mixed")`` vs a plain PyTorch loop, and MFU.

Both train the same model (same seed, built on the GPU), on the same kind of batches, with the same
optimizer (the module's own AdamW) and the same fused attention (the model's SDPA). bf16 mixed is
done the same way on both sides: bf16 weights and gradients, fp32 master weights the AdamW steps,
forward under ``torch.autocast(bf16)``.

The two alternate in one process: the Trainer's fit runs, and a callback, after every
``segment_steps`` of its steps, runs ``segment_steps`` steps of the plain loop. Each segment is
timed on its own (CUDA-synchronized at both ends), so the Trainer's segments hold whole loop
iterations including what Lightning does between batches, and neither holds the other's. Warm-up
steps of both loops are excluded. The ratio is taken within each round and its median reported.

MFU = tokens/s x (6 N + 12 L h s) / peak, with N the weights a token multiplies with (embedding
lookup excluded, head included) and the attention term without causal halving: the planner's model
FLOPs (``lightning_5d.estimate``, docs/planner.md).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Iterator

import lightning as L
import torch

from benchmarks.gpu.hardware import Card, Deadline, peak_allocated, reset_peak, sync
from benchmarks.gpu.part import PartContext, count, pct, table, verdict
from benchmarks.gpu.workload import MODEL_1B, Sizes, build_data, build_module, loss_of, make_trainer, planner_estimate

TARGET_RATIO = 0.97  # tokens/s of the Trainer over the plain loop
TARGET_MFU = 0.45


class PlainLoop:
    """What a user writes by hand: bf16 weights, an fp32 master copy in the optimizer, forward under
    autocast, loss, backward, move the gradients to the masters, AdamW step, copy back."""

    def __init__(self, module: L.LightningModule, batches: Iterator[dict], device: torch.device) -> None:
        self.module, self.batches, self.device = module, batches, device
        module.to(dtype=torch.bfloat16)
        built = module.configure_optimizers()  # the module's own AdamW, as Lightning would build it
        optimizer = built["optimizer"] if isinstance(built, dict) else built
        self.pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        groups = []
        for group in optimizer.param_groups:
            masters = []
            for p in group["params"]:
                master = torch.nn.Parameter(p.detach().float())
                self.pairs.append((p, master))
                masters.append(master)
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": masters})
        self.optimizer = type(optimizer)(groups)  # every setting of the module's optimizer, over the masters
        self.last_loss: torch.Tensor | None = None

    def step(self) -> None:
        batch = {k: v.to(self.device) for k, v in next(self.batches).items()}
        with torch.autocast(self.device.type, dtype=torch.bfloat16, cache_enabled=False):
            loss = self.module._loss(batch)  # what training_step computes, without its self.log
        loss.backward()
        for p, master in self.pairs:
            master.grad, p.grad = p.grad.float(), None
        self.optimizer.step()
        with torch.no_grad():
            for p, master in self.pairs:
                p.copy_(master)
        self.optimizer.zero_grad(set_to_none=True)
        self.last_loss = loss.detach()

    def run(self, steps: int) -> float:
        """Seconds for ``steps`` steps, synchronized at both ends."""
        sync(self.device)
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        sync(self.device)
        return time.perf_counter() - start


class Alternate(L.Callback):
    """Times the Trainer in segments and runs a segment of the plain loop after each."""

    def __init__(self, plain: PlainLoop, sizes: Sizes, deadline: Deadline, device: torch.device) -> None:
        self.plain, self.sizes, self.deadline, self.device = plain, sizes, deadline, device
        self.trainer_s: list[float] = []
        self.plain_s: list[float] = []
        self.stopped_early = False
        self.last_loss: torch.Tensor | None = None
        self._start = 0.0

    def _mark(self) -> None:
        sync(self.device)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.last_loss = loss_of(outputs)
        done, warmup, seg = batch_idx + 1, self.sizes.warmup, self.sizes.segment_steps
        if done == warmup:
            self.plain.run(warmup)  # the plain loop's own warm-up, untimed
            self._mark()
        elif done > warmup and (done - warmup) % seg == 0:
            sync(self.device)
            self.trainer_s.append(time.perf_counter() - self._start)
            self.plain_s.append(self.plain.run(seg))
            round_s = self.trainer_s[-1] + self.plain_s[-1]
            if len(self.trainer_s) < self.sizes.rounds and not self.deadline.allows(round_s):
                self.stopped_early = trainer.should_stop = True
            self._mark()


def measure(ctx: PartContext) -> dict[str, Any]:
    sizes, device = ctx.sizes, ctx.device
    max_steps = sizes.warmup + sizes.rounds * sizes.segment_steps
    reset_peak(device)
    plain_module = build_module(sizes, device)
    plain_data = build_data(sizes, max_steps)
    plain_data.setup("fit")
    plain = PlainLoop(plain_module, iter(plain_data.train_dataloader()), device)
    alternate = Alternate(plain, sizes, ctx.deadline, device)
    trainer = make_trainer(device, max_steps, [alternate])
    module = build_module(sizes, device)
    trainer.fit(module, datamodule=build_data(sizes, max_steps))
    if not alternate.trainer_s:
        raise RuntimeError(f"no timed segment completed within the part's budget (warm-up {sizes.warmup} steps)")
    est = planner_estimate(sizes)
    flops_per_token = est.flops.model_per_token
    tokens = sizes.tokens_per_step * sizes.segment_steps
    ours = statistics.median(tokens / s for s in alternate.trainer_s)
    theirs = statistics.median(tokens / s for s in alternate.plain_s)
    ratio = statistics.median(p / t for p, t in zip(alternate.plain_s, alternate.trainer_s))
    peak = ctx.card.peak_flops

    def mfu(tokens_per_s: float) -> float | None:
        return None if peak is None else tokens_per_s * flops_per_token / peak

    strategy = trainer.strategy
    return {
        "params": est.params.total,
        "flops_per_token": flops_per_token,
        "layout": f"{strategy.layout.describe()}, zero={int(strategy.config.zero)}",
        "rounds": len(alternate.trainer_s),
        "stopped_at_budget": alternate.stopped_early,
        "segment_steps": sizes.segment_steps,
        "trainer_segment_s": alternate.trainer_s,
        "plain_segment_s": alternate.plain_s,
        "tokens_per_s": {"five_d": ours, "plain": theirs},
        "ratio": ratio,
        "mfu": {"five_d": mfu(ours), "plain": mfu(theirs)},
        "final_loss": {"five_d": float(alternate.last_loss), "plain": float(plain.last_loss)},
        "peak_allocated_bytes": peak_allocated(device),  # both models resident: not the planner's number
        "targets": {"ratio": TARGET_RATIO, "mfu": TARGET_MFU},
        "met": {"ratio": ratio >= TARGET_RATIO, "mfu": None if mfu(ours) is None else mfu(ours) >= TARGET_MFU},
    }


def markdown(r: dict[str, Any], sizes: Sizes, card: Card) -> list[str]:
    ours, theirs = r["tokens_per_s"]["five_d"], r["tokens_per_s"]["plain"]
    rows = [
        ["tokens/s, `Trainer(strategy=FiveDStrategy(), precision=\"bf16-mixed\")`", f"{ours:,.0f}", "", ""],
        ["tokens/s, plain PyTorch loop", f"{theirs:,.0f}", "", ""],
        ["ratio FiveDStrategy / plain", f"{r['ratio']:.3f}", f"≥ {TARGET_RATIO}", verdict(r["met"]["ratio"])],
        ["MFU, FiveDStrategy", pct(r["mfu"]["five_d"]), f"≥ {TARGET_MFU:.0%}", verdict(r["met"]["mfu"])],
        ["MFU, plain loop", pct(r["mfu"]["plain"]), "", ""],
    ]
    shape = " (TinyLlama-1.1B shape)" if sizes.model == MODEL_1B else ""
    lines = [
        f"{count(r['params'])} parameters{shape}, seq {sizes.seq}, batch {sizes.batch}, bf16 mixed "
        f"(bf16 weights, fp32 master AdamW, lr {sizes.lr}); layout the planner chose: {r['layout']}. "
        f"{sizes.warmup} warm-up steps each, then {r['rounds']} rounds alternating {r['segment_steps']} Trainer steps "
        f"and {r['segment_steps']} plain-loop steps in one process; medians over rounds"
        + (" (stopped at the part's time budget)." if r["stopped_at_budget"] else "."),
        "",
        *table(["figure", "measured", "target", ""], rows),
        "",
        f"MFU = tokens/s × (6N + 12·L·h·s) / peak, {r['flops_per_token']:.3e} FLOP per token; "
        f"peak: {card.peak_source}. Loss after the last step: {r['final_loss']['five_d']:.4f} (FiveDStrategy), "
        f"{r['final_loss']['plain']:.4f} (plain): both train, on batches of the same data in their own order.",
    ]
    return lines

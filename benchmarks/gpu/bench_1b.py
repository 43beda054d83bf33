"""A ~1B Llama-style model on one GPU: ``Trainer(strategy=FiveDStrategy(...))`` vs a plain PyTorch loop.

    python -m benchmarks.gpu.bench_1b                       # bf16, TinyLlama-1.1B shape, 3 repeats
    python -m benchmarks.gpu.bench_1b --peak-tflops 989     # peak bf16 dense FLOP/s of the GPU, for MFU
    python -m benchmarks.gpu.bench_1b --smoke               # tiny model, runs on CPU too: checks the script

Both sides train the same ``LlamaLM`` (same seed, same weights), on the same data
(``TextDataModule``), with the same optimizer (the module's own AdamW), in bf16 autocast
with fp32 parameters (Lightning ``precision="bf16-mixed"``; the loop uses ``torch.autocast``).
Each run is its own process (clean allocator, honest peak memory); runs alternate
plain / 5d for ``--repeats`` rounds and the ratio ours/plain is taken within each round,
then the median. Step time: CUDA-synchronized wall time over the timed steps after
``--warmup`` steps. MFU = the planner's model FLOPs per step (``lightning_5d.estimate``:
6·N_matmul + 12·L·s·h per token) / step time / peak FLOP/s. Target: ours/plain ≥ 0.97.
FP8 recipes: pending the precision plugin (issue 8).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
# TinyLlama-1.1B's shape (1.10 B parameters with its 32,000-token vocabulary).
MODEL_1B = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_layers": 22, "num_heads": 32,
            "num_kv_heads": 4, "max_seq_len": 2048}  # fmt: skip
MODEL_SMOKE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
               "num_kv_heads": 2, "max_seq_len": 64}  # fmt: skip
# Dense bf16 tensor-core peak per GPU (vendor data sheets, without sparsity), by device-name fragment.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 70.0}
FP8_NOTE = "FP8 recipes: pending the precision plugin (issue 8)"


class NoGPUError(SystemExit):
    pass


def peak_flops(arg: float | None) -> float | None:
    if arg is not None:
        return arg * 1e12
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v * 1e12 for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


# --------------------------------------------------------------------------- one run (child process)
def _setup(cfg: dict, seq: int, batch: int, total_steps: int):
    import lightning as L

    from lightning_5d.models import LlamaConfig, LlamaLM, TextDataModule

    L.seed_everything(0, verbose=False)
    module = LlamaLM(LlamaConfig(**cfg))
    data = TextDataModule(seq_len=seq, batch_size=batch, num_samples=batch * total_steps, val_samples=1)
    return module, data


def run_plain(cfg: dict, seq: int, batch: int, warmup: int, steps: int, device: torch.device) -> dict:
    """What a user would write by hand: forward, loss, backward, AdamW step, zero_grad."""
    import torch.nn.functional as F

    module, data = _setup(cfg, seq, batch, warmup + steps)
    module.to(device)
    optimizer = module.configure_optimizers()  # the module's own AdamW, as Lightning would build it
    data.setup("fit")
    start = None
    for i, batch_data in enumerate(data.train_dataloader()):
        if i == warmup:
            _sync(device)
            start = time.perf_counter()
        input_ids, labels = batch_data["input_ids"].to(device), batch_data["labels"].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = module(input_ids)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i == warmup + steps - 1:
            break
    _sync(device)
    return {"step_s": (time.perf_counter() - start) / steps}


def run_5d(cfg: dict, seq: int, batch: int, warmup: int, steps: int, device: torch.device, zero: int) -> dict:
    import lightning as L

    import lightning_5d

    class Timer(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch_data, batch_idx):
            if batch_idx == warmup - 1:
                _sync(device)
                self.start = time.perf_counter()
            elif batch_idx == warmup + steps - 1:
                _sync(device)
                self.step_s = (time.perf_counter() - self.start) / steps

    module, data = _setup(cfg, seq, batch, warmup + steps)
    timer = Timer()
    trainer = L.Trainer(
        accelerator=device.type, devices=1, strategy=lightning_5d.FiveDStrategy(zero=zero), precision="bf16-mixed",
        max_steps=warmup + steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, callbacks=[timer],
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    return {"step_s": timer.step_s}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def child(args: argparse.Namespace) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = MODEL_SMOKE if args.smoke else MODEL_1B
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    if args.child == "plain":
        out = run_plain(cfg, args.seq, args.batch, args.warmup, args.steps, device)
    else:
        out = run_5d(cfg, args.seq, args.batch, args.warmup, args.steps, device, args.zero)
    out["peak_memory_bytes"] = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    Path(args.child_out).write_text(json.dumps(out))


# --------------------------------------------------------------------------- driver
def _run_child(variant: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        cmd = [sys.executable, "-m", "benchmarks.gpu.bench_1b", "--child", variant, "--child-out", str(out),
               "--seq", str(args.seq), "--batch", str(args.batch), "--warmup", str(args.warmup),
               "--steps", str(args.steps), "--zero", str(args.zero)] + (["--smoke"] if args.smoke else [])  # fmt: skip
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0:
            tail = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            raise RuntimeError(f"{variant} run failed (exit {proc.returncode}):\n{tail}")
        return json.loads(out.read_text())


def measure(args: argparse.Namespace) -> dict:
    if not torch.cuda.is_available() and not args.smoke:
        raise NoGPUError(
            "bench_1b needs a CUDA GPU (torch.cuda.is_available() is False here). Run it on a GPU machine with "
            "the CUDA build of torch: `python -m benchmarks.gpu.bench_1b`; `--smoke` checks the script on CPU."
        )
    from lightning_5d.estimate import estimate, load_spec
    from lightning_5d.models import LlamaConfig, LlamaLM

    cfg = MODEL_SMOKE if args.smoke else MODEL_1B
    with torch.device("meta"):  # shapes only: the planner needs the config, not a second copy of the weights
        spec = load_spec(LlamaLM(LlamaConfig(**cfg)))
    est = estimate(spec, dp_shard=1, zero=args.zero, precision="bf16", seq_len=args.seq, micro_batch_size=args.batch)
    peak = peak_flops(args.peak_tflops)
    rounds = []
    for _ in range(args.repeats):
        rounds.append({variant: _run_child(variant, args) for variant in ("plain", "5d")})
    tokens = args.seq * args.batch
    out = {"model": cfg, "params": est.params.total, "seq": args.seq, "batch": args.batch, "steps": args.steps,
           "warmup": args.warmup, "zero": args.zero, "repeats": args.repeats, "peak_flops": peak,
           "model_flops_per_step": est.flops.model_per_step, "rounds": rounds,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (smoke)"}  # fmt: skip
    for variant in ("plain", "5d"):
        step = statistics.median(r[variant]["step_s"] for r in rounds)
        out[variant] = {"step_s": step, "tokens_per_s": tokens / step,
                        "mfu": est.mfu(step, peak) if peak else None,
                        "peak_memory_bytes": rounds[0][variant]["peak_memory_bytes"]}  # fmt: skip
    out["ratio_tokens_per_s"] = statistics.median(r["plain"]["step_s"] / r["5d"]["step_s"] for r in rounds)
    return out


def markdown(result: dict) -> str:
    if "status" in result:
        return f"**{result['status']}.** {FP8_NOTE}."
    lines = [
        f"{result['device']}; {result['params'] / 1e9:.2f} B parameters, seq {result['seq']}, batch {result['batch']}, "
        f"bf16 autocast + fp32 AdamW; {result['warmup']} warm-up + {result['steps']} timed steps, "
        f"{result['repeats']} alternating rounds, medians.",
        "",
        "| variant | tokens/s | MFU | peak memory (GiB) |",
        "|---|---:|---:|---:|",
    ]
    for variant, label in (("plain", "plain PyTorch loop"), ("5d", f"`FiveDStrategy(zero={result['zero']})`")):
        v = result[variant]
        mfu = f"{v['mfu']:.1%}" if v["mfu"] is not None else "n/a (give --peak-tflops)"
        mem = f"{v['peak_memory_bytes'] / 2**30:.2f}" if v["peak_memory_bytes"] else "n/a"
        lines.append(f"| {label} | {v['tokens_per_s']:,.0f} | {mfu} | {mem} |")
    r = result["ratio_tokens_per_s"]
    lines += ["", f"tokens/s ours / plain: {r:.3f}{'' if r >= 0.97 else ' ✗'} (target ≥ 0.97). {FP8_NOTE}."]
    if result["device"].endswith("(smoke)"):
        lines.append("Smoke run (tiny model on CPU): it checks that the script works; its speeds mean nothing.")
    return "\n".join(lines)


# --------------------------------------------------------------------------- benchmark registry entry
def run(quick: bool) -> dict:
    """``python -m benchmarks run`` entry: measures on a CUDA machine, records that it did not elsewhere."""
    command = "python -m benchmarks.gpu.bench_1b"
    if not torch.cuda.is_available():
        return {"command": command, "status": "not run: no CUDA GPU on this machine (run the command on a GPU machine)"}
    args = parse_args(["--repeats", "2", "--steps", "10"] if quick else [])
    return {"command": command, **measure(args)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.bench_1b", description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--zero", type=int, default=0, help="one GPU shards nothing: ZeRO-0 (the planner's choice)")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak dense bf16 TFLOP/s (default: by GPU name)")
    p.add_argument("--smoke", action="store_true", help="tiny model, CPU allowed: checks the script, not the speed")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--out", default=None, help="also write the JSON result here")
    p.add_argument("--child", choices=["plain", "5d"], help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.seq, args.batch, args.warmup, args.steps = min(args.seq, 32), min(args.batch, 2), 2, min(args.steps, 3)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    result = measure(args)
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A ~1B Llama-style model on one GPU: ``Trainer(strategy=FiveDStrategy(...))`` vs a plain PyTorch loop.

    python -m benchmarks.gpu.bench_1b                       # bf16, TinyLlama-1.1B shape, 3 repeats
    python -m benchmarks.gpu.bench_1b --peak-tflops 989     # peak bf16 dense FLOP/s of the GPU, for MFU
    python -m benchmarks.gpu.bench_1b --smoke               # tiny model, runs on CPU too: checks the script

Both sides train the same ``LlamaLM`` (same seed, same weights), on the same data
(``TextDataModule``), with the same optimizer (the module's own AdamW), in bf16 mixed
precision as ``FiveDStrategy`` runs it: bf16 parameters and gradients, fp32 master weights
the optimizer steps (``precision="bf16-mixed"``, i.e. ``FiveDPrecision``), forward under
``torch.autocast``; the loop keeps its own fp32 master copy the same way.
Each run is its own process (clean allocator, honest peak memory); runs alternate
plain / 5d for ``--repeats`` rounds and the ratio ours/plain is taken within each round,
then the median. Step time: CUDA-synchronized wall time over the timed steps after
``--warmup`` steps. MFU = the planner's model FLOPs per step (``lightning_5d.estimate``:
6·N_matmul + 12·L·s·h per token) / step time / peak FLOP/s. Target: ours/plain ≥ 0.97.

FP8: ``--fp8 tensorwise,delayed,blockwise,mxfp8`` (the default) adds one ``FiveDStrategy`` run per
recipe with ``FiveDPrecision("fp8", recipe=...)`` (backend ``auto``: Transformer Engine where it is
installed and the GPU supports the recipe, else ours), and reports each one's step time against
bf16 in the same round.
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
DEFAULT_FP8 = "tensorwise,delayed,blockwise,mxfp8"


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


def _with_fp32_masters(module: torch.nn.Module) -> tuple[torch.optim.Optimizer, list]:
    """The module's own optimizer, rebuilt over fp32 copies of its (bf16) parameters."""
    built = module.configure_optimizers()  # the module's own AdamW, as Lightning would build it
    optimizer = built["optimizer"] if isinstance(built, dict) else built
    pairs, groups = [], []
    for group in optimizer.param_groups:
        masters = []
        for p in group["params"]:
            master = torch.nn.Parameter(p.detach().float())
            pairs.append((p, master))
            masters.append(master)
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": masters})
    return type(optimizer)(groups), pairs  # each group carries every setting of the original


def run_plain(cfg: dict, seq: int, batch: int, warmup: int, steps: int, device: torch.device) -> dict:
    """What a user would write by hand: bf16 weights, an fp32 master copy, forward, loss, backward,
    AdamW step on the masters, copy back, zero_grad."""
    import torch.nn.functional as F

    module, data = _setup(cfg, seq, batch, warmup + steps)
    module.to(device=device, dtype=torch.bfloat16)
    optimizer, pairs = _with_fp32_masters(module)
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
        for p, master in pairs:
            master.grad, p.grad = p.grad.float(), None
        optimizer.step()
        with torch.no_grad():
            for p, master in pairs:
                p.copy_(master)
        optimizer.zero_grad(set_to_none=True)
        if i == warmup + steps - 1:
            break
    _sync(device)
    return {"step_s": (time.perf_counter() - start) / steps}


def run_5d(
    cfg: dict, seq: int, batch: int, warmup: int, steps: int, device: torch.device, zero: int, fp8: str | None = None
) -> dict:
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
    precision = {"precision": "bf16-mixed"} if fp8 is None else {"plugins": [lightning_5d.FiveDPrecision("fp8", fp8)]}
    trainer = L.Trainer(
        accelerator=device.type, devices=1, strategy=lightning_5d.FiveDStrategy(zero=zero), **precision,
        max_steps=warmup + steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, callbacks=[timer],
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    backend = None if fp8 is None else trainer.precision_plugin.backend.value
    return {"step_s": timer.step_s, "fp8_backend": backend}


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
        fp8 = args.child[len("fp8-") :] if args.child.startswith("fp8-") else None
        out = run_5d(cfg, args.seq, args.batch, args.warmup, args.steps, device, args.zero, fp8)
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
    variants = ["plain", "5d"] + [f"fp8-{r}" for r in args.fp8.split(",") if r]
    rounds = []
    for _ in range(args.repeats):
        rounds.append({variant: _run_child(variant, args) for variant in variants})
    tokens = args.seq * args.batch
    out = {"model": cfg, "params": est.params.total, "seq": args.seq, "batch": args.batch, "steps": args.steps,
           "warmup": args.warmup, "zero": args.zero, "repeats": args.repeats, "peak_flops": peak,
           "model_flops_per_step": est.flops.model_per_step, "rounds": rounds,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (smoke)"}  # fmt: skip
    out["variants"] = variants
    for variant in variants:
        step = statistics.median(r[variant]["step_s"] for r in rounds)
        # FP8 step time over bf16's (the 5d run) in the same round, median over rounds
        vs_bf16 = statistics.median(r[variant]["step_s"] / r["5d"]["step_s"] for r in rounds)
        out[variant] = {"step_s": step, "tokens_per_s": tokens / step,
                        "mfu": est.mfu(step, peak) if peak else None,
                        "peak_memory_bytes": rounds[0][variant]["peak_memory_bytes"],
                        "fp8_backend": rounds[0][variant].get("fp8_backend"), "vs_bf16": vs_bf16}  # fmt: skip
    out["ratio_tokens_per_s"] = statistics.median(r["plain"]["step_s"] / r["5d"]["step_s"] for r in rounds)
    return out


def markdown(result: dict) -> str:
    if "status" in result:
        return (f"**{result['status']}.** When run, it also times each FP8 recipe ({DEFAULT_FP8}) against bf16 "
                "mixed on the same model.")  # fmt: skip
    lines = [
        f"{result['device']}; {result['params'] / 1e9:.2f} B parameters, seq {result['seq']}, batch {result['batch']}, "
        f"bf16 mixed (bf16 weights, fp32 master AdamW); {result['warmup']} warm-up + {result['steps']} timed steps, "
        f"{result['repeats']} alternating rounds, medians. FP8 rows: `FiveDPrecision('fp8', recipe)` on the block "
        f"projections (MFU counts the same model FLOPs against the bf16 peak).",
        "",
        "| variant | tokens/s | MFU | peak memory (GiB) | step time / bf16 |",
        "|---|---:|---:|---:|---:|",
    ]
    for variant in result.get("variants", ["plain", "5d"]):
        label = {"plain": "plain PyTorch loop", "5d": f"`FiveDStrategy(zero={result['zero']})`, bf16 mixed"}.get(
            variant, f"{variant} ({result[variant].get('fp8_backend')})"
        )
        v = result[variant]
        mfu = f"{v['mfu']:.1%}" if v["mfu"] is not None else "n/a (give --peak-tflops)"
        mem = f"{v['peak_memory_bytes'] / 2**30:.2f}" if v["peak_memory_bytes"] else "n/a"
        vs = f"{v['vs_bf16']:.3f}" if "vs_bf16" in v else "-"
        lines.append(f"| {label} | {v['tokens_per_s']:,.0f} | {mfu} | {mem} | {vs} |")
    r = result["ratio_tokens_per_s"]
    lines += ["", f"tokens/s ours / plain (bf16): {r:.3f}{'' if r >= 0.97 else ' ✗'} (target ≥ 0.97)."]
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
    p.add_argument("--fp8", default=DEFAULT_FP8, help="FP8 recipes to time against bf16 ('' for none)")
    p.add_argument("--child", help=argparse.SUPPRESS)
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

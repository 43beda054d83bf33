"""What the plan verifier costs at setup, as a ratio to one training step of the same run.

    python -m benchmarks.verify_cost                 # reference model + the ~0.5B config, tp=2 and zero=3
    python -m benchmarks.verify_cost --only small    # the reference model only (seconds)

Each case is one ``Trainer.fit`` on 2 CPU processes (gloo, fp32, ``OMP_NUM_THREADS=1``),
verifier on: ``verify="blocks"`` (outputs and parameter gradients, the default) or, on the
cases named "outputs", ``verify="outputs"`` (the forward comparison alone). The worker times ``PlanCheck.after`` (the probe forward, the gathers of each
piece's full weights and the reference pieces) and every training step; the ratio is the
verifier's time over the median step after the first (the first pays one-time allocations).
Both numbers come from the same processes, minutes apart at most, so a shared machine's
load hits them alike. Results: ``benchmarks/RESULTS.md`` (section ``verify_cost``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from lightning_5d.testing import run_distributed

# The reference model as the test suite and the other CPU benchmarks use it (~3.4 M parameters).
SMALL = {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 768, "num_layers": 4, "num_heads": 8,
         "num_kv_heads": 4}  # fmt: skip
# ~0.52 B parameters. TinyLlama-1.1B's shape (hidden 2048, 22 layers) builds a 4.4 GB fp32 copy per
# rank before tp shards it: ~13 GB at the peak for 2 ranks, more than this shared 24 GiB machine
# leaves free (~15 GB) next to four other engineers' runs. This is the largest that fits safely.
LARGE = {"vocab_size": 32000, "hidden_size": 1536, "intermediate_size": 4096, "num_layers": 16, "num_heads": 24,
         "num_kv_heads": 8, "max_seq_len": 256}  # fmt: skip
# verify="outputs" is the verifier before it compared gradients (forward only); "blocks", the
# default, adds one backward per piece. Both on the same case, one launch each.
CASES = {
    "small tp=2 outputs": ("small", ["--tp", "2", "--verify", "outputs"]),
    "small tp=2": ("small", ["--tp", "2"]),
    "small tp=2 sp outputs": ("small", ["--tp", "2", "--sp", "--verify", "outputs"]),
    "small tp=2 sp": ("small", ["--tp", "2", "--sp"]),
    "small zero=3": ("small", ["--zero", "3"]),
    "large tp=2 outputs": ("large", ["--tp", "2", "--verify", "outputs"]),
    "large tp=2": ("large", ["--tp", "2"]),
}
SEQ_LEN, BATCH, STEPS = 128, 2, 4


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    import torch.distributed as dist

    import lightning_5d
    from lightning_5d.models import LlamaConfig, LlamaLM, TextDataModule
    from lightning_5d.verify.check import PlanCheck

    torch.set_num_threads(1)
    seconds: list[float] = []
    cpu_seconds: list[float] = []  # this process's CPU time: less moved by other jobs on a shared machine
    original = PlanCheck.after

    def timed_after(self, *a, **k):
        start, cpu = time.perf_counter(), time.process_time()
        try:
            return original(self, *a, **k)
        finally:
            seconds.append(time.perf_counter() - start)
            cpu_seconds.append(time.process_time() - cpu)

    PlanCheck.after = timed_after

    class StepTimes(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.cpu_times: list[float] = []

        def on_train_batch_start(self, *_a) -> None:
            self.start, self.cpu = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, *_a) -> None:
            self.times.append(time.perf_counter() - self.start)
            self.cpu_times.append(time.process_time() - self.cpu)

    class SGDLM(LlamaLM):  # plain SGD: no optimizer state, so the large config fits next to its gradients
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    config = LlamaConfig(**json.loads(args.model))
    torch.manual_seed(0)
    module = SGDLM(config)
    params = sum(p.numel() for p in module.parameters())
    kwargs = {"tp": args.tp, "sequence_parallel": args.sp} if args.tp > 1 else {"zero": args.zero}
    kwargs["verify"] = args.verify
    timer = StepTimes()
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=lightning_5d.FiveDStrategy(**kwargs),
        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer],
    )  # fmt: skip
    data = TextDataModule(seq_len=SEQ_LEN, batch_size=BATCH, num_samples=64)
    trainer.fit(module, datamodule=data)
    steps = sorted(timer.times[1:])
    cpu_steps = sorted(timer.cpu_times[1:])
    if dist.get_rank() == 0:
        result = {"verify_s": seconds[0], "step_s": steps[len(steps) // 2], "steps": timer.times, "params": params,
                  "verify_cpu_s": cpu_seconds[0], "step_cpu_s": cpu_steps[len(cpu_steps) // 2]}  # fmt: skip
        Path(args.out).write_text(json.dumps(result))


def run(only: str | None) -> dict:
    results = {}
    for name, (size, extra) in CASES.items():
        if only and not name.startswith(only):
            continue
        model = SMALL if size == "small" else LARGE
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "r.json"
            argv = ["--worker", "--model", json.dumps(model), "--out", str(out), *extra]
            launch = run_distributed(Path(__file__), 2, argv, timeout=900, env={"OMP_NUM_THREADS": "1"})
            if launch.returncode != 0 or not out.exists():
                raise RuntimeError(f"{name} failed:\n{launch.output[-3000:]}")
            r = json.loads(out.read_text())
        r["ratio"] = r["verify_s"] / r["step_s"]
        r["cpu_ratio"] = r["verify_cpu_s"] / r["step_cpu_s"]
        results[name] = r
        print(f"{name}: {r['params'] / 1e6:.1f} M params, verifier {r['verify_s']:.2f} s, "
              f"step {r['step_s']:.2f} s, ratio {r['ratio']:.2f}; CPU: verifier {r['verify_cpu_s']:.2f} s, "
              f"step {r['step_cpu_s']:.2f} s, ratio {r['cpu_ratio']:.2f}", flush=True)  # fmt: skip
    return results


def markdown(results: dict, wall_s: float) -> str:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [
        "## verify_cost",
        "",
        "- command: `python -m benchmarks.verify_cost`",
        f"- machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        f"- date: {time.strftime('%Y-%m-%d')}; wall time {wall_s:.0f} s; load average at the end: {load}",
        "",
        f"The plan verifier (`FiveDStrategy(verify='blocks')`, the default) against one training step of the same "
        f"run: 2 CPU processes, fp32, batch {BATCH} x {SEQ_LEN} tokens per data rank, SGD; step = median of steps "
        f"2..{STEPS}. `small` is the reference model of the CPU benchmarks ({SMALL}); `large` is {LARGE} — the "
        f"~1.1B TinyLlama shape does not fit this shared 24 GiB machine with 2 processes (its fp32 build alone "
        f"peaks near 13 GB while ~15 GB are free), so this is the largest config run.",
        "",
        "| case | parameters | verifier | one step | verifier / step | verifier CPU | step CPU | CPU ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        lines.append(f"| {name} | {r['params'] / 1e6:.1f} M | {r['verify_s']:.2f} s | {r['step_s']:.2f} s | "
                     f"{r['ratio']:.2f} | {r['verify_cpu_s']:.2f} s | {r['step_cpu_s']:.2f} s | "
                     f"{r['cpu_ratio']:.2f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--model", default=json.dumps(SMALL))
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--sp", action="store_true")
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--out", default="")
    parser.add_argument("--verify", default="blocks", choices=["blocks", "outputs"])
    parser.add_argument("--only", default=None, help="cases whose name starts with this (small, large)")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        from lightning_5d.testing import leave_process_group

        leave_process_group()
        return
    start = time.perf_counter()
    results = run(args.only)
    print(markdown(results, time.perf_counter() - start))


if __name__ == "__main__":
    sys.exit(main())

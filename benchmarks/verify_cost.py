"""What the plan verifier costs at setup, as a ratio to one training step of the same run.

    python -m benchmarks.verify_cost                 # reference model (tp=2, zero=3) + the ~1.1B config (tp=2)
    python -m benchmarks.verify_cost --only small    # the reference model only (seconds)
    python -m benchmarks.verify_cost --trace         # + rank 0's RSS around each verifier step, per piece

Each case is one ``Trainer.fit`` on 2 CPU processes (gloo, fp32, ``OMP_NUM_THREADS=1``),
verifier on: ``verify="blocks"`` (outputs and parameter gradients, the default) or, on the
cases named "outputs", ``verify="outputs"`` (the forward comparison alone). The worker times
``PlanCheck.after`` (the probe forward, the gathers of each piece's full weights, the
reference pieces and, with gradients, each piece's second forward and both backwards) and
every training step, in wall and in this process's CPU time; the ratio is the verifier's
time over the median step after the first (the first pays one-time allocations). Both
numbers come from the same processes, minutes apart at most, and all cases run one after
the other in one invocation, so a shared machine's load hits them alike; the load average
is recorded at each case's start and end. The large config is built on the meta device
(``trainer.init_module(empty_init=True)``: each rank materializes its tp half only), as
a 1.1B fp32 model built whole on each of 2 processes does not fit this machine. Results:
``benchmarks/RESULTS.md`` (section ``verify_cost``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import SMALL, as_worker
from lightning_5d.testing import run_distributed

# TinyLlama-1.1B's shape (1.1 B parameters), built on the meta device: each of the 2 ranks holds
# its tp half (2.2 GB fp32) and SGD's gradients, ~10 GB together on this shared 24 GiB machine.
LARGE = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_layers": 22, "num_heads": 32,
         "num_kv_heads": 4, "max_seq_len": 256}  # fmt: skip
# verify="outputs": the forward comparison alone; "blocks", the default, adds one more forward and
# one backward per piece on each side (under ZeRO-3 with the piece's unit gathered). Both on the
# same case, one launch each, side by side.
CASES = {
    "small tp=2 outputs": ("small", ["--tp", "2", "--verify", "outputs"]),
    "small tp=2": ("small", ["--tp", "2"]),
    "small zero=3 outputs": ("small", ["--zero", "3", "--verify", "outputs"]),
    "small zero=3": ("small", ["--zero", "3"]),
    "large tp=2 outputs": ("large", ["--tp", "2", "--verify", "outputs", "--meta"]),
    "large tp=2": ("large", ["--tp", "2", "--meta"]),
}
SEQ_LEN, BATCH, STEPS = 128, 2, 4
LARGE_STEPS = 3  # the median of steps 2..3: a 1.1B step takes minutes on this machine


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

    peaks: list[float] = []  # this process's peak RSS (MiB) before and after the verifier
    trace = None
    if args.trace:  # rank 0's RSS around each of the verifier's steps (benchmarks/verify_phases.py)
        from benchmarks.verify_phases import PhaseTrace

        trace = PhaseTrace()
        trace.install()
    shares: list[float] = []  # the RSS when the verifier starts: the rank's share

    def timed_after(self, *a, **k):
        peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        shares.append(_rss_mib())
        start, cpu = time.perf_counter(), time.process_time()
        try:
            return original(self, *a, **k)
        finally:
            seconds.append(time.perf_counter() - start)
            cpu_seconds.append(time.process_time() - cpu)
            after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            if trace is not None:
                # The trace resets the kernel's high-water mark (which ru_maxrss reads) before each
                # step: the verifier's peak is the highest of its steps' peaks.
                after = max([peaks[0], *(row["peak_mib"] for row in trace.rows)])
            peaks.append(after)

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
    kwargs = {"tp": args.tp, "sequence_parallel": args.sp} if args.tp > 1 else {"zero": args.zero}
    kwargs["verify"] = args.verify
    timer = StepTimes()
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=lightning_5d.FiveDStrategy(**kwargs),
        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer],
    )  # fmt: skip
    if args.meta:
        with trainer.init_module(empty_init=True):
            module = SGDLM(config)
    else:
        module = SGDLM(config)
    params = sum(p.numel() for p in module.parameters())
    data = TextDataModule(seq_len=SEQ_LEN, batch_size=BATCH, num_samples=64)
    trainer.fit(module, datamodule=data)
    steps = sorted(timer.times[1:])
    cpu_steps = sorted(timer.cpu_times[1:])
    if dist.get_rank() == 0:
        result = {"verify_s": seconds[0], "step_s": steps[len(steps) // 2], "steps": timer.times, "params": params,
                  "verify_cpu_s": cpu_seconds[0], "step_cpu_s": cpu_steps[len(cpu_steps) // 2],
                  "peak_mib": peaks[:2],
                  "final_peak_mib": max(peaks[1], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}
        result["share_mib"] = shares[0]
        Path(args.out).write_text(json.dumps(result))
        if trace is not None:
            from benchmarks.verify_phases import dump

            dump(trace, shares[0], args.trace)


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run(only: str | None, trace: bool = False) -> dict:
    results = {}
    for name, (size, extra) in CASES.items():
        if only and not name.startswith(only):
            continue
        model = SMALL if size == "small" else LARGE
        steps = STEPS if size == "small" else LARGE_STEPS
        load_start = os.getloadavg()[0]
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "r.json"
            argv = ["--worker", "--model", json.dumps(model), "--out", str(out), "--steps", str(steps), *extra]
            phases = Path(tmp) / "phases.json"
            if trace:
                argv += ["--trace", str(phases)]
            launch = run_distributed(Path(__file__), 2, argv, timeout=3000, env={"OMP_NUM_THREADS": "1"})
            if launch.returncode != 0 or not out.exists():
                raise RuntimeError(f"{name} failed:\n{launch.output[-3000:]}")
            r = json.loads(out.read_text())
            if trace:
                from benchmarks.verify_phases import summary

                r["phases"] = json.loads(phases.read_text())
                print(f"{name}: rank 0's RSS around the verifier's steps\n{summary(r['phases'])}", flush=True)
        r["load"] = (load_start, os.getloadavg()[0])
        r["ratio"] = r["verify_s"] / r["step_s"]
        r["cpu_ratio"] = r["verify_cpu_s"] / r["step_cpu_s"]
        results[name] = r
        print(f"{name}: {r['params'] / 1e6:.1f} M params, verifier {r['verify_s']:.2f} s, "
              f"step {r['step_s']:.2f} s, ratio {r['ratio']:.2f}; CPU: verifier {r['verify_cpu_s']:.2f} s, "
              f"step {r['step_cpu_s']:.2f} s, ratio {r['cpu_ratio']:.2f}; load {r['load'][0]:.1f} -> "
              f"{r['load'][1]:.1f}; rank 0 peak RSS {r['peak_mib'][0]:.0f} MiB before the verifier, "
              f"{r['peak_mib'][1]:.0f} after, {r['final_peak_mib']:.0f} at the end", flush=True)  # fmt: skip
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
        f"The plan verifier (`FiveDStrategy(verify=...)`) against one training step of the same "
        f"run: 2 CPU processes, fp32, batch {BATCH} x {SEQ_LEN} tokens per data rank, SGD; step = median of steps "
        f"2..{STEPS} (large: 2..{LARGE_STEPS}). `small` is the reference model of the CPU benchmarks ({SMALL}); "
        f"`large` is TinyLlama-1.1B's shape ({LARGE}), built on the meta device.",
        "",
        "| case | parameters | verifier | one step | verifier / step | verifier CPU | step CPU | CPU ratio | load "
        "| peak RSS before / after verifier / end (rank 0) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        lines.append(f"| {name} | {r['params'] / 1e6:.1f} M | {r['verify_s']:.2f} s | {r['step_s']:.2f} s | "
                     f"{r['ratio']:.2f} | {r['verify_cpu_s']:.2f} s | {r['step_cpu_s']:.2f} s | "
                     f"{r['cpu_ratio']:.2f} | {r['load'][0]:.0f}–{r['load'][1]:.0f} | {r['peak_mib'][0]:.0f} / "
                     f"{r['peak_mib'][1]:.0f} / {r['final_peak_mib']:.0f} MiB |")  # fmt: skip
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
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--meta", action="store_true", help="build on the meta device (init_module(empty_init=True))")
    parser.add_argument("--only", default=None, help="cases whose name starts with this (small, large)")
    parser.add_argument("--trace", nargs="?", const="yes", default="",
                        help="rank 0's RSS around each verifier step, per piece (benchmarks/verify_phases.py); "
                             "--save-trace FILE keeps every row")  # fmt: skip
    parser.add_argument("--save-trace", default="", help="with --trace: write every case's rows to this JSON file")
    args = parser.parse_args()
    if args.worker:
        as_worker(worker, args)
        return
    start = time.perf_counter()
    results = run(args.only, bool(args.trace))
    if args.save_trace:
        Path(args.save_trace).write_text(json.dumps({k: r.get("phases") for k, r in results.items()}, indent=1))
    print(markdown(results, time.perf_counter() - start))


if __name__ == "__main__":
    sys.exit(main())

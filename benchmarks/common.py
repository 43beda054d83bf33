"""Shared by the benchmarks: start the training worker on N processes, medians, formatting."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

from lightning_5d.testing import run_distributed

WORKER = Path(__file__).parent / "workers" / "train.py"

# Dimensions whose benchmarks wait for their implementation (issue numbers of the tracker).
PENDING = {"cp": 5, "pp": 6, "ep": 7}


class WorkerFailed(RuntimeError):
    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output  # the run's whole console output, for the report of a real failure


def run_worker(nproc: int, args: Sequence[str], timeout: float = 300.0) -> dict:
    """One training run of ``benchmarks/workers/train.py``; its JSON result (rank 0's view of all ranks).

    No retry: a crash is a finding, not noise to average away.
    """
    return _run_once(nproc, args, timeout)


def _run_once(nproc: int, args: Sequence[str], timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        run = run_distributed(WORKER, nproc, [*args, "--out", str(out)], timeout=timeout)
        if run.timed_out or run.returncode != 0 or not out.exists():
            reason = first_error(run.output) or f"exit {run.returncode}, timed out: {run.timed_out}"
            if not first_error(run.output):  # no Python exception: say what the ranks printed last
                reason += "; output tail:\n" + "\n".join(_tail(run.output))
            raise WorkerFailed(reason, run.output)
        return json.loads(out.read_text())


def _tail(output: str, lines: int = 25) -> list[str]:
    return [line for line in output.splitlines() if "Warning" not in line and line.strip()][-lines:]


_EXCEPTION_LINE = re.compile(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception)): (.+)$")


def first_error(output: str) -> str | None:
    """The first exception a rank printed (``SomeError: message``), launcher errors excluded."""
    for line in output.splitlines():
        m = _EXCEPTION_LINE.match(line.strip())
        if m and m.group(1) != "ChildFailedError":
            return f"{m.group(1)}: {m.group(2)}"
    return None


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def pending_note(dim: str) -> str:
    return f"pending: dimension not landed (issue {PENDING[dim]})"


def fmt_bytes(n: float) -> str:
    return f"{n:,.0f}"


def results_section(name: str, result: dict) -> list[str]:
    """One benchmark's section of RESULTS.md: heading, command, machine, date, wall time, its markdown."""
    meta = [f"- command: `{result['command']}`", f"- machine: {result['machine']}", f"- date: {result['date']}"]
    if "elapsed_s" in result:
        meta.append(f"- wall time: {result['elapsed_s']:.0f} s; load average at start: {result['load_average']}")
    return [f"## {name}", "", *meta, "", result["markdown"], ""]


def as_worker(worker: Callable[[argparse.Namespace], None], args: argparse.Namespace) -> None:
    """``worker(args)`` in a rank the benchmark launched, then the rank leaves the process group."""
    worker(args)
    from lightning_5d.testing import leave_process_group

    leave_process_group()


def alternating_main(
    script: Path,
    worker: Callable[[argparse.Namespace], None],
    summarize: Callable[[list], dict],
    markdown: Callable[[dict, float], str],
    what: str,
) -> None:
    """The command line of a standalone benchmark whose worker alternates steps with and without
    ``what`` in one fit on 2 processes (``pipeline_failure_flag``, ``step_watch_cost``): ``--pairs``
    steps of each kind; rank 0 of the worker writes every rank's rows as JSON to ``--out``; this
    prints the summary and its RESULTS.md section."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--pairs", type=int, default=20, help=f"steps {what} and as many without")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.worker:
        as_worker(worker, args)
        return
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        argv = ["--worker", "--pairs", str(args.pairs), "--out", str(out)]
        launch = run_distributed(script, 2, argv, timeout=900, env={"OMP_NUM_THREADS": "1"})
        if launch.returncode != 0 or not out.exists():
            raise RuntimeError(f"the worker failed:\n{launch.output[-3000:]}")
        result = summarize(json.loads(out.read_text()))
    print(json.dumps(result))
    print(markdown(result, time.perf_counter() - start))


# The reference model as the test suite and the CPU benchmarks use it (~3.4 M parameters, 4 blocks).
SMALL = {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 768, "num_layers": 4, "num_heads": 8,
         "num_kv_heads": 4}  # fmt: skip
SEQ_LEN, BATCH, WARMUP = 128, 4, 3


def alternating_fit(strategy, switch: Callable, pairs: int, extra: Callable[[], dict] = dict):
    """One fit of ``SMALL`` (seed 0, batch ``BATCH`` x ``SEQ_LEN``) on this rank, 1 thread, with
    ``switch(trainer, on)`` before each step: on for the ``WARMUP`` steps and every even step
    after, so both ranks switch together. Returns the module and this rank's rows after the
    warm-up: ``on``, ``step_s`` (wall), ``step_cpu_s`` (this process) and ``extra()``'s keys."""
    import lightning as L
    import torch

    from lightning_5d.models import LlamaConfig, LlamaLM, TextDataModule

    torch.set_num_threads(1)
    rows: list[dict] = []

    class Alternate(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.on = batch_idx < WARMUP or batch_idx % 2 == 0
            switch(trainer, self.on)
            self.start, self.cpu = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx >= WARMUP:
                rows.append({"on": self.on, "step_s": time.perf_counter() - self.start,
                             "step_cpu_s": time.process_time() - self.cpu, **extra()})  # fmt: skip

    torch.manual_seed(0)
    module = LlamaLM(LlamaConfig(**SMALL))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=WARMUP + 2 * pairs, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Alternate()],
    )  # fmt: skip
    trainer.fit(module, datamodule=TextDataModule(seq_len=SEQ_LEN, batch_size=BATCH,
                                                  num_samples=BATCH * (WARMUP + 2 * pairs)))  # fmt: skip
    return module, rows


def write_ranks(mine: dict, out: str) -> None:
    """Every rank's ``mine``, written by rank 0 to ``out`` as JSON (a collective)."""
    import torch.distributed as dist

    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(ranks))


def paired(rows: list[dict], keys: Sequence[str] = ("step_s", "step_cpu_s")) -> dict:
    """Medians of ``keys`` over the rows with the switch on and off, and their ratios (on / off)."""
    on = [x for x in rows if x["on"]]
    off = [x for x in rows if not x["on"]]
    out: dict = {"steps_each": min(len(on), len(off))}
    for key in keys:
        name = key.removesuffix("_s")
        out[f"{name}_on_s"] = statistics.median(x[key] for x in on)
        out[f"{name}_off_s"] = statistics.median(x[key] for x in off)
        out[f"{name}_ratio"] = out[f"{name}_on_s"] / out[f"{name}_off_s"]
    return out


def alternating_head(name: str, wall_s: float) -> list[str]:
    """The first lines of an alternating benchmark's RESULTS.md section: its command and where it ran."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return [
        f"## {name}",
        "",
        f"- command: `python -m benchmarks.{name}`",
        f"- machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        f"- date: {time.strftime('%Y-%m-%d')}; wall time {wall_s:.0f} s; load average at the end: {load}",
        "",
    ]


def ratio_cell(ranks_row: dict, key: str = "step") -> str:
    """``paired``'s ratio for ``key`` with its two medians: "1.004 (40 / 39 ms)"."""
    on, off = ranks_row[f"{key}_on_s"] * 1e3, ranks_row[f"{key}_off_s"] * 1e3
    return f"{ranks_row[f'{key}_ratio']:.3f} ({on:.0f} / {off:.0f} ms)"

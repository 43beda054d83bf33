"""Start a script on several local processes (torch.distributed.run, gloo) with a hard timeout.

Used by the multi-process tests and the benchmarks. A hang becomes a failed run: on
timeout the whole process group of the launcher is killed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence


@dataclass
class DistributedRun:
    returncode: int
    output: str
    timed_out: bool

    def check(self) -> "DistributedRun":
        if self.timed_out:
            raise AssertionError(f"distributed run timed out; output tail:\n{self.output[-6000:]}")
        if self.returncode != 0:
            raise AssertionError(f"distributed run failed (exit {self.returncode}); output tail:\n{self.output[-6000:]}")
        return self


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_distributed(
    script: str | Path,
    nproc: int,
    args: Sequence[str] = (),
    timeout: float = 240.0,
    env: dict[str, str] | None = None,
) -> DistributedRun:
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(script), *args,
    ]  # fmt: skip
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        return DistributedRun(proc.returncode, out, timed_out=False)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return DistributedRun(-9, out or "", timed_out=True)

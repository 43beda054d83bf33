"""Start the ranks of one ``l5d train`` job.

On one machine the job runs ``python -m torch.distributed.run --standalone
--nproc-per-node <devices> lightning_5d/worker_boot.py [--catch <requeue signals>]
<run dir>/resolved.yaml`` (worker.py); Lightning
sees the torchelastic variables and does not launch processes of its own. Workers'
output is streamed to this process's stdout and copied to ``<run dir>/workers.log``.
A hard timeout stops the whole process group, and the workers die with this process
(``PR_SET_PDEATHSIG``), so a hang or a killed parent leaves nothing behind.

Inside a job that already has its ranks (``srun`` with ``SLURM_NTASKS > 1``, or
``torchrun``) nothing is launched: :func:`distributed_env` says so and the caller runs
the worker in-process.
"""

from __future__ import annotations

import os
import signal
import site
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional, Sequence, TextIO


class WorkersFailed(RuntimeError):
    """The workers exited non-zero or ran past their time limit."""


def distributed_env() -> Optional[str]:
    """``"torchelastic"`` or ``"slurm"`` when this process already is one rank, else None.

    Same tests as Lightning's ``TorchElasticEnvironment.detect`` and
    ``SLURMEnvironment.detect``, except that one SLURM task (``SLURM_NTASKS=1``, e.g. a
    plain ``sbatch`` script) is not a distributed job: there we still start workers.
    """
    if {"RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"} <= os.environ.keys():
        return "torchelastic"
    try:
        ntasks = int(os.environ.get("SLURM_NTASKS", "1"))
    except ValueError:
        ntasks = 1
    if ntasks > 1 and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return "slurm"
    return None


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or 1)


def env_rank() -> int:
    return int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0)


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    # One thread per worker unless the user chose: N workers each spawning one thread
    # per core oversubscribe the CPU badly (torchrun would set 1 too, with a warning).
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"  # stream lines as they are printed
    # The workers must import the same lightning_5d as this process, also from a checkout.
    parent = Path(__file__).resolve().parent.parent
    installed = {Path(p).resolve() for p in site.getsitepackages() + [site.getusersitepackages()]}
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if parent not in installed and str(parent) not in paths:
        env["PYTHONPATH"] = os.pathsep.join([str(parent), *paths])
    return env


def torchrun_command(target: list[str], nproc: int, master_port: Optional[int] = None) -> list[str]:
    """``target``: what each rank runs, e.g. ``["-m", "lightning_5d.worker", cfg]`` or ``[script, *args]``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={nproc}"]
    cmd += ["--max-restarts=0"]
    if master_port:
        cmd += ["--master-addr=127.0.0.1", f"--master-port={master_port}"]
    else:
        cmd += ["--standalone"]  # rendezvous on localhost with a free port
    return cmd + target


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except Exception:  # not Linux: the timeout and the interrupt handler still apply
        pass


def _pump(src: TextIO, sinks: list[TextIO]) -> None:
    for line in src:
        for sink in sinks:
            try:
                sink.write(line)
                sink.flush()
            except (OSError, ValueError):
                pass


def _stop(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM the workers' process group (torchrun forwards it), then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue


def run_ranks(
    target: list[str],
    nproc: int,
    sinks: list[TextIO],
    timeout_s: Optional[float] = None,
    master_port: Optional[int] = None,
    env: Optional[dict[str, str]] = None,
) -> Optional[int]:
    """Run ``nproc`` ranks of ``target`` under torchrun, copying their output to ``sinks``.

    Returns torchrun's exit code, or None if they ran past ``timeout_s`` (then the whole
    process group has been stopped).
    """
    proc = subprocess.Popen(
        torchrun_command(target, nproc, master_port),
        env={**worker_env(), **(env or {})},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        bufsize=1,
        start_new_session=True,  # its own process group: stopped as one on timeout
        preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
    )
    pump = threading.Thread(target=_pump, args=(proc.stdout, sinks), daemon=True)
    pump.start()
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop(proc)
        pump.join(timeout=5)
        return None
    except BaseException:  # KeyboardInterrupt, SystemExit: take the workers down too
        _stop(proc)
        raise
    pump.join(timeout=30)
    return rc


def torchrun(
    resolved: Path,
    nproc: int,
    timeout_s: Optional[float] = None,
    master_port: Optional[int] = None,
    log_file: Optional[Path] = None,
    catch: Sequence[str] = (),
) -> int:
    """Run ``nproc`` workers on ``resolved``; return torchrun's exit code.

    ``catch``: signal names each worker records from its first line (the requeue signals), so
    that one arriving during imports or setup is acted on instead of ending the worker.
    Raises :class:`WorkersFailed` if they run past ``timeout_s`` (they are stopped first).
    """
    boot = Path(__file__).with_name("worker_boot.py")
    target = [str(boot), *(["--catch", ",".join(catch)] if catch else []), str(resolved)]
    log = open(log_file, "a", encoding="utf-8") if log_file else None
    try:
        if log:
            log.write("$ " + " ".join(torchrun_command(target, nproc, master_port)) + "\n")
            log.flush()
        rc = run_ranks(target, nproc, [sys.stdout] + ([log] if log else []), timeout_s, master_port)
    finally:
        if log:
            log.close()
    if rc is None:
        raise WorkersFailed(f"workers ran past launcher.timeout_s={timeout_s}s and were stopped")
    return rc

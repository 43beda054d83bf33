"""The wheels the GPU machine needs and lacks, fetched here (it has no network).

The device image's Python has torch (CUDA), lightning, torchmetrics, numpy, transformers,
safetensors, matplotlib and pytest. Of this project's dependencies that leaves Hydra and OmegaConf,
and OmegaConf's ANTLR runtime. They are pure Python: ``pip wheel --no-deps`` downloads their wheels
(and builds the ANTLR runtime's, which PyPI has only as a source archive) at the versions this
machine runs, into a git-ignored folder that travels with the working tree;
``benchmarks/gpu/device_run.sh`` installs them there with ``--no-index --no-deps``.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

DEFAULT_DIR = ".gpu_wheels"
# What the device image already has (issue 25), by distribution name.
IMAGE_HAS = ("torch", "lightning", "torchmetrics", "numpy", "transformers", "safetensors", "matplotlib", "pytest")
# What it lacks, the project's dependencies and theirs (hydra-core -> omegaconf -> antlr4 runtime).
CARRIED = ("hydra-core", "omegaconf", "antlr4-python3-runtime")


class PrepareError(RuntimeError):
    pass


def normalize(name: str) -> str:
    """A distribution name as wheel file names and pip compare them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned() -> list[str]:
    """``name==version`` for each carried distribution, at the version installed here."""
    try:
        return [f"{name}=={importlib.metadata.version(name)}" for name in CARRIED]
    except importlib.metadata.PackageNotFoundError as err:
        raise PrepareError(
            f"{err.name} is not installed in this environment, so its version to carry is unknown; install the "
            f"project first (pip install -e '.[dev]') and rerun `python -m benchmarks.gpu prepare`."
        ) from None


def wheel_name(path: Path) -> str:
    return normalize(path.name.split("-")[0])


def check_wheels(folder: Path) -> list[Path]:
    """The carried wheels in ``folder``; an error if one is missing or is not pure Python."""
    wheels = sorted(folder.glob("*.whl"))
    by_name = {wheel_name(w): w for w in wheels}
    missing = [name for name in CARRIED if normalize(name) not in by_name]
    impure = [w.name for w in wheels if not w.name.endswith("-none-any.whl")]
    if missing or impure:
        raise PrepareError(
            f"{folder}: missing wheels {missing}, not pure-Python {impure}; delete the folder and rerun "
            f"`python -m benchmarks.gpu prepare`."
        )
    return [by_name[normalize(name)] for name in CARRIED]


def prepare(folder: Path) -> list[Path]:
    """``pip wheel --no-deps`` the carried distributions into ``folder``; the wheel files."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.whl"):  # the device installs every wheel here: no stale second version
        old.unlink()
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(folder), *pinned()]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise PrepareError(f"`{' '.join(cmd)}` failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return check_wheels(folder)

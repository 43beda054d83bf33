"""The wheels the GPU machine needs and lacks, fetched here (it has no network).

The device image's Python has torch (CUDA), lightning, torchmetrics, numpy, transformers,
safetensors, matplotlib and pytest. Of this project's dependencies that leaves Hydra, OmegaConf and
OmegaConf's ANTLR runtime, and pydantic with pydantic-core, annotated-types, typing-inspection and a
typing-extensions new enough for them (the image's, which torch brought, may be older). All are
carried at the versions this machine runs, into a git-ignored folder that travels with the working
tree:

* the pure-Python ones by ``pip wheel --no-deps`` (it builds the ANTLR runtime's wheel, which PyPI
  has only as a source archive);
* pydantic-core, compiled, by ``pip download --only-binary=:all: --platform ... --python-version ...``
  once per CPython in ``PYTHONS`` (the device's version is not known here): one manylinux x86_64 wheel
  each, and the device's pip picks the one its interpreter matches.

``benchmarks/gpu/device_run.sh`` installs them there by name and version with
``--no-index --find-links <folder> --no-deps``.
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
# Dependencies of the carried ones that the image has because its own packages need them (lightning
# requires both), so they are not carried.
IMAGE_BRINGS = ("pyyaml", "packaging")
# What it lacks, the project's dependencies and theirs: hydra-core -> omegaconf -> antlr4 runtime;
# pydantic -> pydantic-core, annotated-types, typing-inspection, typing-extensions (>= 4.16 for pydantic 2.14).
CARRIED = (
    "hydra-core", "omegaconf", "antlr4-python3-runtime",
    "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions",
)  # fmt: skip
# The carried ones that are compiled: one wheel per CPython the device may run.
BINARY = ("pydantic-core",)
PYTHONS = ("3.10", "3.11", "3.12", "3.13")
# manylinux_2_17 is what pydantic-core publishes for x86_64; pip also accepts older-glibc tags under it.
PLATFORM = "manylinux_2_17_x86_64"


class PrepareError(RuntimeError):
    pass


def normalize(name: str) -> str:
    """A distribution name as wheel file names and pip compare them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned(names: tuple[str, ...] = CARRIED) -> list[str]:
    """``name==version`` for each of ``names``, at the version installed here."""
    try:
        return [f"{name}=={importlib.metadata.version(name)}" for name in names]
    except importlib.metadata.PackageNotFoundError as err:
        raise PrepareError(
            f"{err.name} is not installed in this environment, so its version to carry is unknown; install the "
            f"project first (pip install -e '.[dev]') and rerun `python -m benchmarks.gpu prepare`."
        ) from None


def wheel_name(path: Path) -> str:
    return normalize(path.name.split("-")[0])


def cpython_tag(version: str) -> str:
    """``"3.12"`` -> ``"cp312"``, the interpreter and ABI tag of a CPython 3.12 wheel."""
    return "cp" + version.replace(".", "")


def binary_python(path: Path) -> str | None:
    """The CPython (``"3.12"``) a compiled wheel of ``BINARY`` is for; None unless it is one we accept:
    ``cpXY-cpXY-manylinux..._x86_64`` with X.Y in ``PYTHONS`` (no free-threaded, musl or other arch)."""
    if wheel_name(path) not in {normalize(n) for n in BINARY}:
        return None
    python, abi, platforms = path.name[: -len(".whl")].split("-")[-3:]
    by_tag = {cpython_tag(v): v for v in PYTHONS}
    arch_ok = all(p.startswith("manylinux") and p.endswith("_x86_64") for p in platforms.split("."))
    return by_tag[python] if python == abi and python in by_tag and arch_ok else None


def check_wheels(folder: Path) -> list[Path]:
    """The carried wheels in ``folder``; an error if one is missing, if a compiled one lacks a CPython in
    ``PYTHONS``, or if a wheel is neither pure Python nor one of those compiled ones."""
    wheels = sorted(folder.glob("*.whl"))
    binary = [w for w in wheels if binary_python(w) is not None]
    pure = [w for w in wheels if w.name.endswith("-none-any.whl")]
    refused = [w.name for w in wheels if w not in binary and w not in pure]
    have = {wheel_name(w) for w in (*pure, *binary)}
    missing = [name for name in CARRIED if normalize(name) not in have]
    for name in BINARY:
        found = {binary_python(w) for w in binary if wheel_name(w) == normalize(name)}
        missing += [f"{name} (CPython {v})" for v in PYTHONS if v not in found and normalize(name) in have]
    if missing or refused:
        raise PrepareError(
            f"{folder}: missing wheels {missing}, neither pure Python nor {'/'.join(BINARY)} for CPython "
            f"{'/'.join(PYTHONS)} manylinux x86_64: {refused}; delete the folder and rerun "
            f"`python -m benchmarks.gpu prepare`."
        )
    order = {normalize(name): i for i, name in enumerate(CARRIED)}
    return sorted((*pure, *binary), key=lambda w: (order.get(wheel_name(w), len(order)), w.name))


def _pip(args: list[str]) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise PrepareError(f"`{' '.join(cmd)}` failed (exit {done.returncode}):\n{done.stderr[-2000:]}")


def prepare(folder: Path) -> list[Path]:
    """Fetch every carried distribution into ``folder``: ``pip wheel --no-deps`` the pure ones, ``pip
    download`` each compiled one for every CPython in ``PYTHONS``; the wheel files."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.whl"):  # the device installs by name from here: no stale second version
        old.unlink()
    pure = tuple(name for name in CARRIED if name not in BINARY)
    _pip(["wheel", "--no-deps", "--wheel-dir", str(folder), *pinned(pure)])
    for version in PYTHONS:
        _pip(["download", "--no-deps", "--only-binary=:all:", "--implementation", "cp", "--python-version", version,
              "--platform", PLATFORM, "--dest", str(folder), *pinned(BINARY)])  # fmt: skip
    return check_wheels(folder)

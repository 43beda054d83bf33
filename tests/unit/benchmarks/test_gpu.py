"""The one-GPU suite (benchmarks/gpu): its CPU dry mode end to end, the peak table, the carried wheels."""

from __future__ import annotations

import importlib.metadata
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.gpu import fp8_speed, suite, wheels
from benchmarks.gpu.__main__ import build_parser, merge
from benchmarks.gpu.hardware import Deadline, detect_card, peak_for_name
from benchmarks.gpu.part import PartContext

ROOT = Path(__file__).resolve().parents[3]


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[dict, str, Path]:
    """``python -m benchmarks.gpu run --dry`` in its own process (its Trainers make a process group)."""
    out = tmp_path_factory.mktemp("gpu_dry")
    cmd = [sys.executable, "-m", "benchmarks.gpu", "run", "--out", str(out), "--dry"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "gpu.json").read_text()), (out / "gpu.md").read_text(), out


def test_dry_run_measures_every_part(dry_run):
    result, _, _ = dry_run
    assert result["mode"] == "dry" and set(result["parts"]) == set(suite.PARTS)
    errors = {name: part["error"] for name, part in result["parts"].items() if "error" in part}
    assert not errors, errors

    overhead = result["parts"]["overhead"]
    assert overhead["rounds"] == len(overhead["trainer_segment_s"]) == len(overhead["plain_segment_s"]) == 2
    assert _positive(overhead["tokens_per_s"]["five_d"]) and _positive(overhead["tokens_per_s"]["plain"])
    assert _positive(overhead["ratio"]) and overhead["mfu"]["five_d"] is None  # CPU: no peak, no MFU

    fp8 = result["parts"]["fp8"]
    assert set(fp8["recipes"]) == {"tensorwise", "rowwise", "delayed"}
    for recipe, r in fp8["recipes"].items():
        assert r["backend"] == "torch" and r["fp8_linears"] == 7, recipe  # q, k, v, o, gate, up, down
        assert _positive(r["speedup"]) and math.isfinite(r["loss_rel"]), recipe
        assert not r["scaled_mm_refused"], (recipe, r["scaled_mm_refused"])  # torch._scaled_mm ran on CPU

    rows = result["parts"]["attention"]["rows"]
    assert {(r["length"], r["block"], r["kernel"]) for r in rows} == {
        (n, b, k) for n in (32, 64) for b in ("diagonal", "full") for k in ("sdpa", "ring_block")
    }
    assert all(_positive(r["forward_s"]) and _positive(r["forward_backward_s"]) for r in rows)

    mem = result["parts"]["memory"]
    assert mem["command"].startswith("l5d estimate --model ")
    for key in ("params", "grads", "optimizer", "activations"):
        assert _positive(mem["measured"][key]) and _positive(mem["planned"][key]), key
    # Model state is counted exactly by both sides: a wrong layout in the planner call would show here.
    for key in ("params", "grads", "optimizer"):
        assert mem["met"][key], (key, mem["measured"][key], mem["planned"][key])


def test_dry_run_markdown_names_every_target(dry_run):
    result, md, _ = dry_run
    assert md.startswith("## gpu\n") and result["markdown"] in md
    for title, _, _ in suite.PARTS.values():
        assert f"### {title}" in md
    for target in ("≥ 0.97", "≥ 45%", "≥ 1.3", "within 1%", "within 2%", "within 15%"):
        assert target in md, target
    assert "Dry run" in md and "fp8 blockwise: not timed" in md


def test_merge_adds_the_section(dry_run, tmp_path):
    result, _, out = dry_run
    merge(out / "gpu.json", tmp_path)
    assert json.loads((tmp_path / "results.json").read_text())["gpu"]["parts"].keys() == result["parts"].keys()
    assert "## gpu" in (tmp_path / "RESULTS.md").read_text()


def test_a_failing_part_records_its_error_and_the_next_runs(monkeypatch, tmp_path):
    def broken(ctx):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    title, _, render = suite.PARTS["overhead"]
    monkeypatch.setitem(suite.PARTS, "overhead", (title, broken, render))
    sizes = suite.DRY.replace(attention_lengths=(16,))
    result = suite.run_suite(tmp_path, dry=True, command="test", only=("overhead", "attention"), sizes=sizes)
    assert result["parts"]["overhead"]["error"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert len(result["parts"]["attention"]["rows"]) == 4 and "error" not in result["parts"]["attention"]
    md = (tmp_path / "gpu.md").read_text()
    assert "**Failed**" in md and "| L | block |" in md
    assert "part 2. FP8 (torch-native backend) vs bf16: not asked for (--only)" in md


def test_fp8_speedup_pairs_each_pass_and_a_failed_recipe_leaves_the_others(monkeypatch, tmp_path):
    speeds = {"bf16": [100.0, 50.0], "tensorwise": [140.0, 65.0], "delayed": [90.0, 45.0]}  # pass 2: a slower card
    calls: list[str] = []

    def fake_run(variant, sizes, device):
        calls.append(variant)
        if variant == "rowwise":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        loss = 2.0 if variant == "bf16" else 2.03
        tps = speeds[variant][sum(1 for c in calls if c == variant) - 1]
        return {"tokens_per_s": tps, "losses": [3.0, loss], "peak_allocated_bytes": None,
                "backend": None if variant == "bf16" else "torch", "fp8_linears": 7, "scaled_mm_refused": [],
                "wall_s": 0.0}  # fmt: skip

    monkeypatch.setattr(fp8_speed, "run_once", fake_run)
    sizes = suite.DRY.replace(fp8_rounds=2)
    recipes = ("tensorwise", "rowwise", "delayed")
    ctx = PartContext(sizes, detect_card(torch.device("cpu")), Deadline(60), tmp_path, recipes)
    r = fp8_speed.measure(ctx)
    assert calls.count("rowwise") == 1  # not tried again in the second pass
    assert r["recipes"]["rowwise"] == {"error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"}
    tensorwise, delayed = r["recipes"]["tensorwise"], r["recipes"]["delayed"]
    assert tensorwise["speedup"] == pytest.approx(1.35)  # median of 1.4 and 1.3, each against its own pass
    assert tensorwise["met"] == {"speedup": True, "loss": False}  # 1.5 % above bf16's loss
    assert delayed["speedup"] == pytest.approx(0.9) and delayed["met"]["speedup"] is None  # no target set
    md = "\n".join(fp8_speed.markdown(r, sizes, ctx.card))
    assert "failed: `OutOfMemoryError" in md and "| fp8 tensorwise, torch | 102 | 1.350 | ≥ 1.3 | met |" in md


@pytest.mark.parametrize(
    "name, tflops",
    [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
     ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0), ("NVIDIA GH200 480GB", 989.0),
     ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA L40S", 362.0), ("NVIDIA L4", 121.0)],
)  # fmt: skip
def test_peak_by_card_name(name, tflops):
    assert peak_for_name(name)[1] == tflops


def test_unknown_card_or_cpu_gets_no_mfu():
    assert peak_for_name("Tesla T4") is None
    card = detect_card(torch.device("cpu"))
    assert card.peak_flops is None and "MFU not computed" in card.peak_source
    assert detect_card(torch.device("cpu"), peak_tflops=100.0).peak_flops == 100e12


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gives")
def test_full_run_without_gpu_says_how():
    with pytest.raises(suite.NoGpuError, match="--dry"):
        suite.choose_device(dry=False)


def test_bad_fp8_recipe_is_named(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--out", "x", "--fp8-recipes", "tensorwise,fp9"])
    assert "fp9" in capsys.readouterr().err


def test_every_dependency_is_in_the_image_or_carried():
    tomllib = pytest.importorskip("tomllib")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {wheels.normalize(d.split(">")[0].split("=")[0].split("<")[0].strip()) for d in deps}
    covered = {wheels.normalize(n) for n in (*wheels.IMAGE_HAS, *wheels.CARRIED)}
    assert names <= covered, names - covered


def test_carried_ones_need_nothing_the_device_lacks():
    """Each carried distribution's requirements (as installed here, extras off) are carried or in the image;
    what the image brings indirectly is required by one of its packages."""
    from packaging.requirements import Requirement

    covered = {wheels.normalize(n) for n in (*wheels.IMAGE_HAS, *wheels.IMAGE_BRINGS, *wheels.CARRIED)}
    needed = set()
    for name in wheels.CARRIED:
        for line in importlib.metadata.requires(name) or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                needed.add(wheels.normalize(req.name))
    assert {"pydantic-core", "typing-extensions", "pyyaml"} <= needed  # the walk saw pydantic's and omegaconf's
    assert needed <= covered, needed - covered
    image_needs = {wheels.normalize(Requirement(r).name) for r in importlib.metadata.requires("lightning")}
    assert {wheels.normalize(n) for n in wheels.IMAGE_BRINGS} <= image_needs


def _fake_wheels(folder: Path) -> None:
    for name in wheels.CARRIED:
        if name in wheels.BINARY:
            for v in wheels.PYTHONS:
                tag = wheels.cpython_tag(v)
                (folder / f"{name.replace('-', '_')}-2.0-{tag}-{tag}-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"
                 ).write_bytes(b"")  # fmt: skip
        else:
            (folder / f"{name.replace('-', '_')}-1.0-py3-none-any.whl").write_bytes(b"")


def test_check_wheels_wants_every_carried_one_and_each_python_of_the_compiled(tmp_path):
    _fake_wheels(tmp_path)
    made = wheels.check_wheels(tmp_path)
    assert len(made) == len(wheels.CARRIED) - len(wheels.BINARY) + len(wheels.BINARY) * len(wheels.PYTHONS)
    assert list(dict.fromkeys(wheels.wheel_name(w) for w in made)) == [wheels.normalize(n) for n in wheels.CARRIED]
    (tmp_path / "omegaconf-1.0-py3-none-any.whl").unlink()
    next(tmp_path.glob("pydantic_core-*-cp312-*.whl")).unlink()
    with pytest.raises(wheels.PrepareError, match=r"missing wheels \['omegaconf', 'pydantic-core \(CPython 3.12\)'\]"):
        wheels.check_wheels(tmp_path)


@pytest.mark.parametrize(
    "refused",
    ["numpy-2.0-cp311-cp311-manylinux_2_17_x86_64.whl",  # compiled, not one we carry
     "pydantic_core-2.0-cp313-cp313t-manylinux_2_17_x86_64.whl",  # free-threaded
     "pydantic_core-2.0-cp39-cp39-manylinux_2_17_x86_64.whl",  # a CPython outside PYTHONS
     "pydantic_core-2.0-cp312-cp312-musllinux_1_1_x86_64.whl",
     "pydantic_core-2.0-cp312-cp312-manylinux_2_17_aarch64.manylinux2014_aarch64.whl"],
)  # fmt: skip
def test_check_wheels_refuses_other_compiled_wheels(tmp_path, refused):
    _fake_wheels(tmp_path)
    (tmp_path / refused).write_bytes(b"")
    with pytest.raises(wheels.PrepareError, match=r"missing wheels \[\], .*" + re.escape(refused)):
        wheels.check_wheels(tmp_path)

"""The production recipes (Llama-3 8B/70B/405B, Mixtral-8x7B on 8..1024 H100s) cannot run here, so the
planner checks each one: composed exactly as `l5d train` would, its layout's predicted memory per GPU
must fit the recipe's GPU (H100 80 GB unless its `cluster:` says otherwise), and its predicted MFU is
printed (`pytest -rP` or `-s` shows it; `l5d estimate --recipe NAME` prints the whole estimate).
"""

import json
import re
from pathlib import Path

import pytest

from lightning_5d.estimate import GIB, get_preset
from lightning_5d.estimate.recipe_check import check_recipe, check_recipe_name
from lightning_5d.train import compose, validate

ROOT = Path(__file__).resolve().parents[3]
# recipe -> (nodes, planner preset with the same shape)
PRODUCTION = {
    "llama3_8b_8gpu": (1, "llama3-8b"),
    "llama3_70b_64gpu": (8, "llama3-70b"),
    "llama3_405b_1024gpu": (128, "llama3-405b"),
    "mixtral_8x7b_32gpu": (4, "mixtral-8x7b"),
}
H100_GIB = 80


@pytest.fixture(scope="module")
def composed():
    return {name: compose([f"recipe={name}"], return_hydra_config=True) for name in PRODUCTION}


@pytest.fixture(scope="module")
def checks(composed):
    return {name: check_recipe(cfg) for name, cfg in composed.items()}


@pytest.mark.parametrize("recipe", PRODUCTION)
def test_production_recipe_fits_and_prints_its_predicted_mfu(recipe, checks, composed):
    check, cfg = checks[recipe], composed[recipe]
    print(check.summary())
    for note in check.notes:
        print(f"  note: {note}")
    assert check.recipe == recipe
    assert check.cluster.gpu_memory_gib == cfg.get("cluster", {}).get("gpu_memory_gib", H100_GIB) == H100_GIB
    assert check.fits, check.format()
    assert check.memory_bytes < H100_GIB * GIB
    assert not check.problems, check.format()
    # The planner's MFU ceiling is its assumed compute efficiency; a sane layout loses little of it.
    assert 0.35 < check.predicted_mfu <= check.cluster.compute_efficiency + 1e-9
    assert check.bubble_fraction < 0.02


@pytest.mark.parametrize("recipe", PRODUCTION)
def test_production_layout_multiplies_to_devices_times_nodes(recipe, checks, composed):
    check, cfg = checks[recipe], composed[recipe]
    nodes, _ = PRODUCTION[recipe]
    assert (cfg.devices, cfg.num_nodes) == (8, nodes)
    layout = validate(cfg)
    s = check.setup
    assert s.dp_replicate * s.dp_shard * s.tp * s.cp * s.pp == layout.world_size == cfg.devices * cfg.num_nodes
    assert (s.dp_replicate, s.dp_shard, s.tp, s.cp, s.pp, s.ep) == (
        layout.dp_replicate, layout.dp_shard, layout.tp, layout.cp, layout.pp, layout.ep,
    )  # fmt: skip
    # Batch as the workers read it: data.batch_size sequences per data rank, split into the pipeline's microbatches.
    assert s.global_batch == cfg.data.batch_size * layout.dp * cfg.trainer.accumulate_grad_batches
    assert s.seq_len == cfg.data.seq_len and check.cluster.gpus_per_node == cfg.devices
    assert s.tp <= cfg.devices  # tp's per-layer collectives stay on NVLink


@pytest.mark.parametrize("recipe", PRODUCTION)
def test_production_model_is_the_published_shape(recipe, checks):
    _, preset = PRODUCTION[recipe]
    spec, published = checks[recipe].spec, get_preset(preset)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "kv_heads",
                  "tie_embeddings", "num_experts", "expert_width"):  # fmt: skip
        assert getattr(spec, field) == getattr(published, field), field
    if published.is_moe:
        assert spec.experts_top_k == published.experts_top_k


@pytest.mark.parametrize("recipe", PRODUCTION)
def test_production_recipe_slurm_settings(recipe, composed):
    """Requeue on SIGUSR2 before the limit, one task per GPU, whole requeueable nodes - in the sbatch header."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    slurm = pytest.importorskip("submitit.slurm.slurm")
    cfg = composed[recipe]
    launcher = cfg.hydra.launcher
    assert cfg.hydra.runtime.choices["hydra/launcher"] == "slurm_requeue"
    assert cfg.requeue.enabled is True and cfg.resume == "auto"
    assert launcher.nodes == cfg.num_nodes and launcher.tasks_per_node == launcher.gpus_per_node == cfg.devices
    sbatch = slurm._make_sbatch_string(
        command="python -m submitit.core._submit x",
        folder="/tmp/l5d-submitit",
        time=launcher.timeout_min,
        nodes=launcher.nodes,
        ntasks_per_node=launcher.tasks_per_node,
        gpus_per_node=launcher.gpus_per_node,
        signal_delay_s=launcher.signal_delay_s,
        additional_parameters=dict(launcher.additional_parameters),
    ).splitlines()
    name, delay = re.search(r"--signal=(?:B:)?(\w+)@(\d+)", "\n".join(sbatch)).groups()
    assert f"SIG{name}" in cfg.requeue.signals and "SIGTERM" in cfg.requeue.signals
    assert 60 <= int(delay) <= launcher.timeout_min * 60 / 10
    assert {"#SBATCH --requeue", "#SBATCH --exclusive", f"#SBATCH --nodes={cfg.num_nodes}"} <= set(sbatch)
    assert f"#SBATCH --ntasks-per-node={cfg.devices}" in sbatch


def test_production_numbers_in_the_docs_are_the_planners(checks):
    """docs/planner.md's "Production recipes" table shows what `l5d estimate --recipe` prints today."""
    text = (ROOT / "docs" / "planner.md").read_text(encoding="utf-8")
    for name, check in checks.items():
        rows = [line for line in text.splitlines() if line.startswith(f"| `{name}` |")]
        assert len(rows) == 1, name
        cells = [c.strip() for c in rows[0].strip("|").split("|")]
        assert f"{check.memory_gib:.1f}" in cells, (name, cells)
        assert f"{100 * check.predicted_mfu:.1f} %" in cells, (name, cells)


def test_uneven_pipeline_stages_are_modelled_as_the_most_loaded_stage(checks):
    check = checks["llama3_405b_1024gpu"]
    assert check.spec.num_layers == 126 and check.setup.pp * check.setup.v == 32
    assert check.modelled_layers == 128  # 32 stages x 4 blocks, the stage_blocks' maximum
    assert any("126 blocks into 32 stages of 3..4" in note for note in check.notes)
    # The slowest stage sets the step; MFU counts only the real model's FLOPs.
    assert check.predicted_mfu == pytest.approx(check.time.predicted_mfu * check.model_flops_per_step
                                                / check.estimate.flops.model_per_step)  # fmt: skip
    assert check.predicted_mfu < check.time.predicted_mfu


def test_the_check_is_not_vacuous():
    """The same recipes with a worse choice: does not fit, or the runtime would refuse it."""
    zero1 = check_recipe_name("llama3_8b_8gpu", ["parallel.zero=1"])
    assert not zero1.fits and zero1.memory_gib > zero1.usable_gib
    zero3_zbv = check_recipe_name("llama3_70b_64gpu", ["parallel.zero=3", "parallel.pipeline.schedule=zbv",
                                                      "parallel.pipeline.virtual_stages=2"])  # fmt: skip
    assert any("zero=3 with pipeline.schedule=zbv" in p for p in zero3_zbv.problems)
    assert not check_recipe_name("llama3_70b_64gpu", ["parallel.zero=3"]).problems  # interleaved 1F1B runs
    moe_tp = check_recipe_name("mixtral_8x7b_32gpu", ["parallel.tp=2"])
    assert any("replicates them over tp" in p for p in moe_tp.problems)
    cost = check_recipe_name("llama3_70b_64gpu", ["parallel.pipeline.balance=cost"])
    assert cost.modelled_layers > 80 and cost.memory_gib > check_recipe_name("llama3_70b_64gpu").memory_gib
    h200 = check_recipe_name("llama3_8b_8gpu", gpu_memory_gib=141)
    assert h200.usable_gib == pytest.approx(141 * 0.9)


def test_405b_in_fp8_fits_and_prints_its_predicted_mfu():
    check = check_recipe_name("llama3_405b_1024gpu", ["precision=fp8_rowwise"])
    print(check.summary())
    assert check.setup.precision.value == "fp8" and check.cluster.peak_flops == 1979e12
    assert check.fits and not check.problems


def test_l5d_estimate_recipe(l5d):
    code, out, _ = l5d(["estimate", "--recipe", "mixtral_8x7b_32gpu", "--json"])
    assert code == 0
    data = json.loads(out)
    assert data["recipe"] == "mixtral_8x7b_32gpu" and data["fits"] is True and data["problems"] == []
    assert data["setup"]["ep"] == 8 and data["setup"]["world_size"] == 32 and 0 < data["predicted_mfu"] < 1
    code, out, _ = l5d(["estimate", "--recipe", "llama3_8b_8gpu", "parallel.zero=1"])
    assert code == 1 and "does NOT fit" in out
    code, _, err = l5d(["estimate", "--recipe", "no_such_recipe"])
    assert code == 2 and "no_such_recipe" in err
    code, _, err = l5d(["estimate", "--tp", "2"])
    assert code == 2 and "--recipe" in err

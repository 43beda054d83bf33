"""Fine-tuning with frozen parameters: they stay frozen and hold no gradient or optimizer state;
unfreezing them during training matches one process where the layout supports it and is
refused before a wrong step where it does not (lightning_5d/parallel/frozen.py).

Frozen here: the embedding (vocab-parallel under tp), one column-cut projection and one norm
whose gradient sequence parallelism sums over tp. The reference freezes (and unfreezes) the
same parameters of the unchanged model in one process (tests/distributed/scripts/reference.py).
"""

import json
import re

import lightning as L
import pytest
import torch

from reference import reference_run
from tests_support import (MODELS, SCRIPTS, LayoutRuns, RecordingLM, assert_equivalent, parameter_vector_error,
                           run_distributed, selected_cases)

from lightning_5d.config import ParallelConfig, ZeroStage
from lightning_5d.dimensions import combination_for
from lightning_5d.dryrun.startup import startup_classes
from lightning_5d.dryrun.state import StateRules

FROZEN = r"embed_tokens|layers\.0\.attention\.q_proj|layers\.1\.mlp_norm"
MOE_FROZEN = r"router|shared_experts"
STEPS = 4
BF16 = ("--precision", "bf16-mixed", "--reduce-dtype", "bf16")  # FiveDPrecision: bf16 parameters, fp32 masters
UNFREEZE_AT = 2

# (nproc, zero, tp, pp, extra script args)
FAST = [
    (2, 1, 2, 1, ("--sp", "--build", "meta")),  # tp + SP: frozen shards and a frozen SP norm
    (2, 2, 1, 1, ()),  # ZeRO-2 over 2 ranks: no bucket, slice or moment for the frozen ones
    (2, 3, 1, 1, ("--build", "meta", "--unfreeze-at", str(UNFREEZE_AT))),  # FSDP2 reduces whatever has a gradient
    (2, 1, 1, 1, BF16),  # bf16 parameters: no fp32 master for a frozen one (bytes only: the reference is fp32)
    # LoRA (peft's layout) on q_proj and v_proj, everything else frozen: data parallelism needs no plan
    (2, 3, 1, 1, ("--build", "meta", "--freeze", "lora")),
    (2, 1, 1, 1, ("--freeze", "lora")),
]
EXTENDED = [
    (4, 3, 2, 1, ("--sp", "--build", "meta", "--unfreeze-at", str(UNFREEZE_AT))),
    (4, 3, 1, 2, ("--build", "meta", "--microbatches", "2", "--unfreeze-at", str(UNFREEZE_AT))),
    (4, 1, 2, 1, ()),  # tp2 x ZeRO-1 over 2 data ranks
    (2, 1, 1, 2, ("--build", "meta", "--microbatches", "2")),
    (2, 1, 1, 1, ("--build", "meta", "--cp", "2")),
    # MoE fine-tuning: router and shared experts frozen, routed experts trained, under ep2
    (2, 1, 1, 1, ("--build", "meta", "--ep", "2", "--model", "tiny_moe", "--freeze", MOE_FROZEN)),
    (4, 3, 2, 1, ("--build", "meta", "--ep", "2", "--model", "tiny_moe", "--freeze", MOE_FROZEN,
                  "--unfreeze-at", str(UNFREEZE_AT))),  # fmt: skip
]
PARAMS = "nproc,zero,tp,pp,extra"


def layout_case(test_name: str, params: dict):
    if not test_name.startswith("test_frozen_"):
        return None
    key = tuple(params[name] for name in PARAMS.split(","))
    nproc, zero, tp, pp, extra = key
    options = dict(zero=zero, steps=STEPS, tp=tp, extra=("--pp", str(pp), "--freeze", FROZEN, *extra))
    return key, (nproc, options)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    return LayoutRuns(tmp_path_factory.mktemp("frozen"), selected_cases(request, layout_case))


def _arg(extra, flag, default=None):
    return extra[extra.index(flag) + 1] if flag in extra else default


def check(runs, nproc, zero, tp, pp, extra):
    result, params = runs[(nproc, zero, tp, pp, extra)]
    cp = int(_arg(extra, "--cp", 1))
    unfreeze = _arg(extra, "--unfreeze-at")
    unfreeze = None if unfreeze is None else int(unfreeze)
    bf16 = extra == BF16
    pattern, model = _arg(extra, "--freeze", FROZEN), _arg(extra, "--model", "tiny")
    if not bf16:
        ref_losses, ref_params = reference_run(STEPS, nproc // (tp * pp * cp), model=model, freeze=pattern,
                                               unfreeze_at=unfreeze)  # fmt: skip
        assert_equivalent(result["losses"], params, ref_losses, ref_params)
        frozen = [k for k in ref_params if ("lora_" not in k if pattern == "lora" else re.search(pattern, k))]
        assert len(frozen) >= 3
        if unfreeze is None:  # bit for bit the initial values one process keeps
            assert all(torch.equal(params[k], ref_params[k]) for k in frozen)
        else:  # and they trained once unfrozen
            L.seed_everything(0, verbose=False)
            initial = RecordingLM(MODELS[model]).state_dict()
            assert not any(torch.equal(params[k], initial[k]) for k in frozen)
    # What each rank measured before its 2nd optimizer step (still frozen then) is what the
    # start-up dry run counts for a model built with these parameters frozen.
    config = ParallelConfig.from_mapping({"zero": zero, "tp": tp, "pp": pp, "cp": cp, "dp_shard": "auto",
                                          "ep": int(_arg(extra, "--ep", 1)),
                                          "sequence_parallel": "--sp" in extra,
                                          "pipeline": {"microbatches": _arg(extra, "--microbatches")}})  # fmt: skip
    layout = config.resolve(nproc)
    rules = StateRules(zero=ZeroStage(zero), low_precision_params=bf16)
    combination = combination_for(config, layout, None, False)
    classes = startup_classes(lambda: RecordingLM(MODELS[model], freeze=pattern), config, layout, combination, rules)
    counted = {r: c.state for c in classes for r in c.ranks}
    for rank, measured in enumerate(result["model_state_bytes"]):
        state = counted[rank]
        assert (measured["params"], measured["grads"], measured["optimizer"]) == (
            state.params, state.grads, state.optimizer), rank  # fmt: skip


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize(PARAMS, FAST)
def test_frozen_parameters_train_as_in_one_process(runs, nproc, zero, tp, pp, extra):
    check(runs, nproc, zero, tp, pp, extra)


@pytest.mark.distributed
@pytest.mark.extended
@pytest.mark.timeout(600)
@pytest.mark.parametrize(PARAMS, EXTENDED)
def test_frozen_parameters_train_as_in_one_process_more_layouts(runs, nproc, zero, tp, pp, extra):
    check(runs, nproc, zero, tp, pp, extra)


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout,frozen,expected", [
    (("--zero", "1"), FROZEN, "3 parameter(s) frozen when FiveDStrategy set up training now require gradients "
                              "(model.embed_tokens.weight, model.layers.0.attention.q_proj.weight, model.layers.1.mlp_norm.weight), "
                              "but zero=1 reduces and shards only"),
    (("--zero", "1", "--tp", "2", "--sp"), r"layers\.1\.mlp_norm", "but tensor parallelism sums the partial gradients"),
    (("--zero", "1", "--tp", "2", *BF16), r"layers\.0\.attention\.q_proj", "so these would be stepped in bf16"),
], ids=["zero1-dp2", "tp2-sp-one-data-rank", "bf16-masters-one-data-rank"])  # fmt: skip
def test_unfreezing_where_the_layout_left_frozen_parameters_out_is_refused_before_a_wrong_step(
    tmp_path, layout, frozen, expected
):  # fmt: skip
    """ZeRO-0..2's reduction, tp's partial-gradient sums and bf16's fp32 masters were laid out for
    the parameters trainable at setup: one unfrozen later would step on this rank's own (partial)
    gradient, or in bf16. The first backward after it is refused."""
    args = [*layout, "--steps", str(STEPS), "--freeze", frozen, "--unfreeze-at", str(UNFREEZE_AT),
            "--out", str(tmp_path)]  # fmt: skip
    run = run_distributed(SCRIPTS / "train_llama.py", 2, args, timeout=200)
    assert run.returncode != 0 and not run.timed_out, run.output[-3000:]
    assert "FrozenParameterError: " in run.output and expected in run.output, run.output[-3000:]
    assert "use zero=3" in run.output
    assert not (tmp_path / "result.json").exists()


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_unfreezing_on_one_pipeline_stage_stops_every_rank_with_its_error(tmp_path):
    """Only the first stage holds the unfrozen embedding: it refuses inside the run and keeps its
    place in the schedule, and the other stage stops at the run's failure flag, naming it."""
    args = ["--zero", "1", "--pp", "2", "--microbatches", "2", "--build", "meta", "--steps", str(STEPS),
            "--freeze", "embed_tokens", "--unfreeze-at", str(UNFREEZE_AT), "--out", str(tmp_path)]  # fmt: skip
    run = run_distributed(SCRIPTS / "train_llama.py", 4, args, timeout=200)
    assert run.returncode != 0 and not run.timed_out, run.output[-3000:]
    assert run.output.count("FrozenParameterError: 1 parameter(s) frozen") >= 2  # ranks 0 and 1 (stage 0)
    assert "PipelinePeerError: the pipeline stage on rank 0 failed during the training step: " \
           "FrozenParameterError" in run.output  # fmt: skip
    assert "Connection closed by peer" not in run.output


LORA_PLAN = {"model.embed_tokens": "embedding", "model.layers": "blocks",
             "model.layers.*.attention": "attention(heads=4, kv_heads=2)",
             "model.layers.*.attention.q_proj.base_layer": "attention.q", "model.layers.*.attention.k_proj": "attention.k",
             "model.layers.*.attention.v_proj.base_layer": "attention.v", "model.layers.*.attention.o_proj": "attention.o",
             "model.layers.*.mlp.gate_proj": "mlp.column", "model.layers.*.mlp.up_proj": "mlp.column",
             "model.layers.*.mlp.down_proj": "mlp.row", "model.layers.*.attention_norm": "norm",
             "model.layers.*.mlp_norm": "norm", "model.norm": "final_norm", "model.lm_head": "head"}  # fmt: skip


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("plan", [None, LORA_PLAN], ids=["discovered", "model_plan_at_the_base"])
def test_lora_adapters_under_tensor_parallelism_are_refused_before_training(tmp_path, plan):
    """tp cuts plain projections; an adapter's branch is not cut (plan/adapters.py), and a model_plan
    pointed at the base would leave it whole (a shape mismatch in the adapter's forward): refused
    in discovery, naming the wrapper and what trains it."""
    args = ["--zero", "1", "--tp", "2", "--steps", "2", "--freeze", "lora", "--out", str(tmp_path)]
    if plan is not None:
        args += ["--model-plan", json.dumps(plan)]
    run = run_distributed(SCRIPTS / "train_llama.py", 2, args, timeout=200)
    assert run.returncode != 0 and not run.timed_out, run.output[-3000:]
    assert "it holds adapter-wrapped projections: model.layers.0.attention.q_proj (LoraLinear" in run.output
    assert "zero=0..3 needs no plan" in run.output
    assert "ProbeError" not in run.output  # refused in discovery, not by the verifier's run of the model


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_lightnings_backbone_finetuning_trains_under_zero3_and_is_refused_where_the_optimizer_holds_slices(tmp_path):
    """BackboneFinetuning maps optimizer parameters to module names by identity and adds the backbone
    as a new group at epoch 1: ZeRO-3 (the module's own sharded parameters) trains it as one process
    does; under ZeRO-1 (flat slices) it failed inside Lightning with a KeyError, now refused first."""
    script = SCRIPTS / "backbone_finetuning.py"
    two, one = tmp_path / "two.pt", tmp_path / "one.pt"
    run_distributed(script, 2, ["--zero", "1,3", "--batch-size", "2", "--out", str(two)], timeout=240).check()
    run_distributed(script, 1, ["--zero", "3", "--batch-size", "4", "--out", str(one)], timeout=240).check()
    results, reference = torch.load(two), torch.load(one)[3]["params"]
    assert "BackboneFinetuning maps the optimizer's parameters" in results[1]["error"]
    assert "zero=1 the optimizer holds flat fp32 slices" in results[1]["error"]
    assert parameter_vector_error(results[3]["params"], reference) <= 1e-5
    L.seed_everything(0, verbose=False)
    initial = RecordingLM(MODELS["tiny"]).state_dict()
    assert not torch.equal(results[3]["params"]["model.layers.0.attention.q_proj.weight"],
                           initial["model.layers.0.attention.q_proj.weight"])  # the backbone trained once unfrozen

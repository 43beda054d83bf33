"""Pipeline parallelism of unchanged models: training equivalence per schedule, logging, activations in flight.

Each run trains under FiveDStrategy(pp=...) and the same module in one process, fp32,
5 steps, 8 sequences per data rank cut into microbatches: every step's loss within 1e-5
relative and the parameter vector within 1e-5 relative. The fast tier runs 1F1B and
interleaved 1F1B at pp=2, pp x dp with accumulation and clipping, and Hugging Face at
pp=2; every schedule at pp=2 and pp=4, pp x tp, pp x cp and validation are in the full tier.
"""

import json

import pytest
import torch

from hf_support import hf_reference_run
from reference import reference_run
from tests_support import LOSS_RTOL, LayoutRuns, SCRIPTS, assert_equivalent, run_distributed, run_layout, selected_cases

STEPS = 5
BATCH = 8  # per data rank: enough for dualpipev's m >= 2p at pp=4
V = {"afab": 1, "1f1b": 1, "zero_bubble": 1, "interleaved_1f1b": 2, "zbv": 2, "dualpipev": 2}
SCHEDULES = list(V)


def pipeline_args(pp: int, schedule: str, microbatches: int) -> list[str]:
    return ["--pp", str(pp), "--schedule", schedule, "--virtual-stages", str(V[schedule]),
            "--microbatches", str(microbatches), "--batch-size", str(BATCH)]  # fmt: skip


def spec(nproc, pp, schedule, microbatches, tp=1, sp=False, accumulate=1, clip=None, cp=1, zero=1,
         model="tiny_deep") -> tuple:  # fmt: skip
    """One pipeline case, as a hashable key of its settings."""
    return (nproc, pp, schedule, microbatches, tp, sp, accumulate, clip, cp, zero, model)


TIED = "tiny_tied_deep"  # the head's weight is the embedding's: a copy on each end, gradients summed
# test_tied_embeddings' cases: the fast tier's join the 2- and 4-process launches above.
TIED_CASES = {
    "pp2_clip": spec(2, 2, "1f1b", 4, clip=0.5, model=TIED),
    # FSDP2: the two copies' shards summed; the norm counts the weight once; 2 runs per step
    "dp2_pp2_interleaved_zero3_accumulate_clip": spec(4, 2, "interleaved_1f1b", 4, accumulate=2, clip=0.5, zero=3,
                                                      model=TIED),  # fmt: skip
    # ZeRO-2 engines reduce the summed gradient over dp after the pair's sum; 2 runs per step
    "dp2_pp2_zero2_accumulate_clip": spec(4, 2, "1f1b", 4, accumulate=2, clip=0.5, zero=2, model=TIED),
    # vocabulary-parallel embedding and head cut the one weight alike on both ends
    "tp2_sp_pp2_interleaved_clip": spec(4, 2, "interleaved_1f1b", 4, tp=2, sp=True, clip=0.5, model=TIED),
    # zero bubble (split weight gradients), the ends on two ranks
    "pp2_zero_bubble": spec(2, 2, "zero_bubble", 4, model=TIED),
    # pp=4: the pair {rank 0, rank 3} of the pipe is a group of its own; middle stages hold no copy
    "pp4_clip": spec(4, 4, "1f1b", 8, clip=0.5, model=TIED),
}
TIED_FAST = ["pp2_clip", "dp2_pp2_interleaved_zero3_accumulate_clip"]


# Each reference test's case, from its parameters: all of them train through one launch per process count.
SPECS = {
    "test_schedule_matches_single_process": lambda p: spec(2, 2, p["schedule"], 4),
    "test_schedule_matches_single_process_pp2_full": lambda p: spec(2, 2, p["schedule"], 4),
    "test_schedule_matches_single_process_pp4": lambda p: spec(4, 4, p["schedule"], 8),
    # pp=2 x dp_shard=2 (ZeRO-1), two pipeline runs per optimizer step, global-norm clipping
    "test_pipeline_with_data_parallel_accumulation_and_clipping": lambda p: spec(4, 2, "1f1b", 4, accumulate=2, clip=0.5),
    "test_pipeline_with_tensor_parallel": lambda p: spec(4, 2, "interleaved_1f1b", 4, tp=2, sp=True),
    # FSDP2 units hold their gradients for a pipeline run and reduce-scatter once after it; a window of 2
    # Lightning batches adds the second run's sharded gradients to the first's.
    "test_pipeline_with_zero3_accumulation_and_clipping": lambda p: spec(
        4, 2, "interleaved_1f1b", 4, accumulate=2, clip=0.5, zero=3
    ),
    # pp=4: the middle stages hold blocks only; one FSDP root must still own their units.
    "test_pipeline_with_zero3_middle_stages": lambda p: spec(8, 4, "1f1b", 8, zero=3),
    # each microbatch is a slice of this rank's sequence shard; ring attention inside every stage
    "test_pipeline_with_context_parallel": lambda p: spec(4, 2, "1f1b", 4, cp=2),
    "test_tied_embeddings": lambda p: TIED_CASES[p["case"]],
    "test_tied_embeddings_extended": lambda p: TIED_CASES[p["case"]],
}


def layout_case(test_name: str, params: dict):
    if test_name not in SPECS:
        return None
    key = SPECS[test_name](params)
    nproc, pp, schedule, microbatches, tp, sp, accumulate, clip, cp, zero, model = key
    options = dict(zero=zero, accumulate=accumulate, clip=clip, steps=STEPS, tp=tp, sp=sp, cp=cp, model=model,
                   extra=pipeline_args(pp, schedule, microbatches))  # fmt: skip
    return key, (nproc, options)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Every selected reference case of this module, trained in one launch per process count."""
    return LayoutRuns(tmp_path_factory.mktemp("pipeline"), selected_cases(request, layout_case))


def check_reference(runs, request) -> list:
    """The test's case against one process; returns each rank's record."""
    callspec = getattr(request.node, "callspec", None)
    key = SPECS[request.node.originalname](callspec.params if callspec else {})
    nproc, pp, schedule, microbatches, tp, sp, accumulate, clip, cp, zero, model = key
    result, params = runs[key]
    assert (result["layout"]["pp"], result["layout"]["tp"], result["layout"]["cp"]) == (pp, tp, cp)
    data_ranks = nproc // (pp * tp * cp)
    ref_losses, ref_params = reference_run(STEPS, data_ranks, accumulate, clip, model=model, batch_size=BATCH)
    assert_equivalent(result["losses"], params, ref_losses, ref_params)
    # What the unchanged training_step logged: on every rank, its data rank's batch loss. With
    # one data rank that is the reference's loss, step by step, on every pipeline stage.
    ranks = result["model_state_bytes"]
    if data_ranks == 1:
        for record in ranks:
            torch.testing.assert_close(
                torch.tensor(record["logged_losses"]), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0
            )
    return ranks


@pytest.mark.distributed
@pytest.mark.timeout(900)  # the first case of a process count trains its whole batch
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_schedule_matches_single_process(runs, request, schedule):
    check_reference(runs, request)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("schedule", ["afab", "zero_bubble", "zbv", "dualpipev"])
def test_schedule_matches_single_process_pp2_full(runs, request, schedule):
    check_reference(runs, request)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedule_matches_single_process_pp4(runs, request, schedule):
    ranks = check_reference(runs, request)
    # Activations in flight on the first stage (rank 0, stage 0): 1F1B starts the backward of
    # microbatch 0 after p forwards; AFAB runs all m forwards first.
    peak = ranks[0]["peak_in_flight"]["0"]
    if schedule == "1f1b":
        assert peak == 4, f"1F1B held {peak} microbatches on the first stage, expected p=4"
    if schedule == "afab":
        assert peak == 8, f"AFAB held {peak} microbatches on the first stage, expected m=8"


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_pipeline_with_data_parallel_accumulation_and_clipping(runs, request):
    check_reference(runs, request)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pipeline_with_tensor_parallel(runs, request):
    check_reference(runs, request)


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_pipeline_with_zero3_accumulation_and_clipping(runs, request):
    check_reference(runs, request)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pipeline_with_zero3_middle_stages(runs, request):
    check_reference(runs, request)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pipeline_with_context_parallel(runs, request):
    check_reference(runs, request)


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", TIED_FAST)
def test_tied_embeddings(runs, request, case):
    # The full parameters hold the tied weight under both names, equal, as one process's state dict does.
    check_reference(runs, request)


@pytest.mark.distributed
@pytest.mark.extended
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", [c for c in TIED_CASES if c not in TIED_FAST])
def test_tied_embeddings_extended(runs, request, case):
    check_reference(runs, request)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_validation_runs_forward_only_pipeline(tmp_path, schedule):
    # The same validation batches through the pipeline and through one process: the same val_loss.
    piped, single = tmp_path / "pp", tmp_path / "single"
    piped.mkdir(), single.mkdir()
    extra = ["--val-batches", "2"]
    pp_result, _ = run_layout(piped, 2, zero=1, steps=2, model="tiny_deep",
                              extra=[*pipeline_args(2, schedule, 4), *extra])  # fmt: skip
    one_result, _ = run_layout(single, 1, zero=1, steps=2, model="tiny_deep",
                               extra=["--batch-size", str(BATCH), *extra])  # fmt: skip
    pp_val = [r["val_loss"] for r in pp_result["model_state_bytes"]]
    one_val = one_result["model_state_bytes"][0]["val_loss"]
    assert one_val is not None and len(set(pp_val)) == 1, pp_val
    assert pp_val[0] == pytest.approx(one_val, rel=LOSS_RTOL)


# Hugging Face LlamaForCausalLM in the obvious LightningModule (tests/distributed/scripts/hf_support.py)
def check_hf(tmp_path, nproc, pp, schedule, microbatches, layers, tp=1):
    pytest.importorskip("transformers")
    args = ["--model", "llama", "--layers", str(layers), "--tp", str(tp), "--steps", str(STEPS),
            "--out", str(tmp_path), *pipeline_args(pp, schedule, microbatches)]  # fmt: skip
    run_distributed(SCRIPTS / "train_hf.py", nproc, args, timeout=300).check()
    result = json.loads((tmp_path / "result.json").read_text())
    params = torch.load(tmp_path / "params.pt")
    ref_losses, ref_params = hf_reference_run("llama", STEPS, nproc // (pp * tp), layers=layers, batch_size=BATCH)
    assert_equivalent(result["losses"], params, ref_losses, ref_params)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_hugging_face_llama_matches_single_process(tmp_path):
    check_hf(tmp_path, 2, 2, "zbv", microbatches=4, layers=4)


@pytest.mark.distributed
@pytest.mark.extended
@pytest.mark.timeout(400)
@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_hugging_face_llama_every_schedule(tmp_path, pp, schedule):
    check_hf(tmp_path, pp, pp, schedule, microbatches=2 * pp, layers=2 * pp)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hugging_face_llama_pipeline_with_tensor_parallel(tmp_path):
    check_hf(tmp_path, 4, 2, "1f1b", microbatches=4, layers=2, tp=2)

"""All five dimensions at once on the reference model, each run against one process training
the same module on the same data.

The 5D layout is dp_shard=2 x tp=2 x pp=2 x cp=2 on 16 processes: interleaved 1F1B with two
virtual stages per rank, zig-zag ring attention, activation checkpointing of every block. Its
MoE variant takes ep=2 from dp x cp. Sequence parallelism is on for the dense model and off
for MoE, where the runtime refuses it (each tp rank would route a different sequence shard).

- fp32: every step's loss and the final parameter vector within 1e-5 relative, as in each
  dimension's own tests.
- bf16 mixed and FP8 (tensorwise): against one process under the same precision, every step
  within 1 % relative. The layouts reduce in other orders and bf16 rounds each order
  differently; test_precision.py measures ~0.1 % per step for bf16 and sets the same 1 %.

ZeRO-1 and ZeRO-3 each run the dense and the MoE model. On demand (`-m extended`) the other
context-parallel modes run in the same layout: all-to-all at cp=2 on the dense model, and hybrid
(Ulysses pairs x ring of 2, cp=4) on the MoE model as tp=2 x pp=2 x cp=4 x ep=2 (one data rank).
Under ZeRO-3 each stage's FSDP2 units hold their gradients for a pipeline run and reduce-scatter
once after it (parallel/pipeline/fsdp.py).

Wall times on this machine print with the result (pytest -s); the issue note records them.
"""

import functools

import pytest

from reference import reference_run
from tests_support import LayoutRuns, assert_equivalent, parameter_vector_error, relative, selected_cases

STEPS = 5
BATCH = 8  # per data rank; pp cuts it into 4 microbatches of 2
DATA_RANKS = 2  # dp_shard=2 in every layout here; tp, cp and pp ranks share their data rank's batch
INTERLEAVED = ["--pp", "2", "--schedule", "interleaved_1f1b", "--virtual-stages", "2", "--microbatches", "4"]
DENSE = ["--tp", "2", "--sp", "--cp", "2"]
MOE = ["--tp", "2", "--cp", "2", "--ep", "2"]
STEP_RTOL = 0.01  # mixed precision, per step (see above)

# name: (processes, zero, model, dims)
FP32_FAST = {"dense_zero1": (16, 1, "tiny_deep", DENSE + INTERLEAVED)}
FP32_FULL = {
    "moe_zero1": (16, 1, "tiny_moe_deep", MOE + INTERLEAVED),
    "dense_zero3": (16, 3, "tiny_deep", DENSE + INTERLEAVED),
    "moe_zero3": (16, 3, "tiny_moe_deep", MOE + INTERLEAVED),
}
# The other context-parallel modes in the 5D layout (on demand, `-m extended`). All-to-all: the dense
# layout with Ulysses over cp=2 (4 kv heads: 2 per tp rank, 1 per cp rank). Hybrid needs cp=4 (Ulysses
# pairs x ring of 2): tp=2 x pp=2 x cp=4 x ep=2 on 16 processes leaves one data rank, so ZeRO shards over
# the 4 cp ranks (dp x cp) and ep=2 is taken from them.
FP32_EXTENDED = {
    "dense_alltoall_zero1": (16, 1, "tiny_deep_kv4", ["--tp", "2", "--sp", "--cp", "2", "--cp-mode", "alltoall"]
                             + INTERLEAVED),
    "moe_hybrid_zero1": (16, 1, "tiny_moe_deep_kv4", ["--tp", "2", "--cp", "4", "--cp-mode", "hybrid",
                                                      "--cp-ulysses", "2", "--ep", "2"] + INTERLEAVED),
}  # fmt: skip


@functools.cache
def reference(model: str, data_ranks: int = DATA_RANKS):
    return reference_run(STEPS, data_ranks, model=model, batch_size=BATCH)


def data_ranks(nproc: int, dims) -> int:
    """Processes over tp x cp x pp: the data ranks (dp_shard) of a layout."""
    size = {flag: int(dims[dims.index(flag) + 1]) if flag in dims else 1 for flag in ("--tp", "--cp", "--pp")}
    return nproc // (size["--tp"] * size["--cp"] * size["--pp"])


def options(zero, model, dims, precision="32-true", nproc=16) -> dict:
    # One process draws alone what the data ranks draw together (the sampler's same permutation).
    batch = BATCH if nproc > 1 else BATCH * DATA_RANKS
    extra = (*dims, "--ac", "full", "--batch-size", str(batch))
    return dict(zero=zero, steps=STEPS, precision=precision, model=model, extra=extra)


FP32 = {**FP32_FAST, **FP32_FULL, **FP32_EXTENDED}


def layout_case(test_name: str, params: dict):
    if test_name.startswith(("test_five_d_matches_single_process", "test_five_d_other_context_modes")):
        nproc, zero, model, dims = FP32[params["name"]]
        return (params["name"],), (nproc, options(zero, model, tuple(dims)))
    if test_name == "test_five_d_mixed_precision_tracks_single_process":
        precision = params["precision"]
        return {
            ("5d", precision): (16, options(1, "tiny_deep", tuple(DENSE + INTERLEAVED), precision)),
            ("one", precision): (1, options(0, "tiny_deep", (), precision, nproc=1)),
        }
    return None


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The selected cases, one launch per process count: 16 interpreters start once for all 5D runs."""
    return LayoutRuns(tmp_path_factory.mktemp("five_d"), selected_cases(request, layout_case), timeout_per_case=240)


def check_fp32(runs, name, nproc, zero, model, dims):
    result, params = runs[(name,)]
    layout = result["layout"]
    cp = int(dims[dims.index("--cp") + 1])
    wanted = {"dp_shard": data_ranks(nproc, dims), "tp": 2, "cp": cp, "pp": 1 + ("--pp" in dims),
              "ep": 1 + ("--ep" in dims)}  # fmt: skip
    assert {k: layout[k] for k in wanted} == wanted, layout
    ref_losses, ref_params = reference(model, data_ranks(nproc, dims))
    error = parameter_vector_error(params, ref_params)
    print(f"5D {name}: {nproc} processes; parameter error {error:.1e}, layout {layout}")
    assert_equivalent(result["losses"], params, ref_losses, ref_params)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(1500)  # the first case selected trains the whole 16-process batch
@pytest.mark.parametrize("name", list(FP32_FAST))
def test_five_d_matches_single_process(runs, name):
    check_fp32(runs, name, *FP32_FAST[name])


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(1500)  # the first 16-process case trains the whole batch
@pytest.mark.parametrize("name", list(FP32_FULL))
def test_five_d_matches_single_process_full(runs, name):
    check_fp32(runs, name, *FP32_FULL[name])


@pytest.mark.distributed
@pytest.mark.extended
@pytest.mark.timeout(1500)  # the first 16-process case trains the whole batch
@pytest.mark.parametrize("name", list(FP32_EXTENDED))
def test_five_d_other_context_modes_match_single_process(runs, name):
    check_fp32(runs, name, *FP32_EXTENDED[name])


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("precision", ["bf16-mixed", "fp8-tensorwise"])
def test_five_d_mixed_precision_tracks_single_process(runs, precision):
    five_d, _ = runs[("5d", precision)]
    one, _ = runs[("one", precision)]
    rel = relative(five_d["losses"], one["losses"])
    print(f"5D {precision}: 16 processes; max per-step loss difference to one process {rel:.3%}")
    assert rel < STEP_RTOL, (five_d["losses"], one["losses"])

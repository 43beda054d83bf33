"""FP8 all-gather of FSDP2 parameters on 2 gloo ranks (``scripts/fp8_all_gather_check.py``).

One launch runs every case; the script checks each number on every rank (and fails the
run otherwise), these tests then read what it measured:

- every forward sees exactly dequant(quant_tensorwise(full fp32 weight)), also on the
  out= reuse path FSDP takes after the first all-gather and in backward re-gathers;
- each all-gather moves 1 byte per weight element (exact bytes per FSDP unit from the
  shapes, 37 and 23 rows: uneven shards) plus one 4-byte amax all-reduce per weight;
- 5 AdamW steps (and 3 SGD steps) equal, to 1e-6, the run without FP8 all-gather whose
  linears quantize-dequantize their weight in forward;
- HSDP with one shard per replica (FSDP2 skips the all-gather, the hooks still run) is exact;
- with MixedPrecisionPolicy(param_dtype=bf16) the gathered weight is still the fp32
  dequantization; a unit mixing it with a bf16 bias trips FSDP2's uniform-gradient-dtype
  assertion (the documented limit);
- state_dict / full_tensor / get_model_state_dict are plain; DCP round-trips into an FP8
  all-gather model and into a plain one.
"""

import json
import math
from pathlib import Path

import pytest

from tests_support import run_distributed

SCRIPT = Path(__file__).parents[1] / "scripts" / "fp8_all_gather_check.py"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8_all_gather")
    run_distributed(SCRIPT, 2, ["--out", str(out)], timeout=200).check()
    return json.loads((out / "result.json").read_text())


def unit_bytes(rows, cols, bias, weight_bytes, world=2):
    return world * math.ceil(rows / world) * (cols * weight_bytes + (4 if bias else 0))


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_forward_weight_is_the_quantized_full_weight(report):
    exact = report["exact"]
    assert exact["forward_weight_exact"]
    # 3 first all-gathers build the unsharded weights, every later one refills them (out=).
    assert exact["post_all_gather_calls"]["new"] == 3
    assert exact["post_all_gather_calls"]["out"] == 5 * exact["gather_calls_per_step"] - 3


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_all_gather_moves_one_byte_per_weight_element(report):
    exact = report["exact"]
    units = [(37, 16, True), (23, 37, True), (7, 23, False)]
    fp8 = {unit_bytes(*u, 1) for u in units}
    fp32 = {unit_bytes(*u, 4) for u in units}
    assert fp8 == {760, 984, 184} and fp32 == {2584, 3648, 736}
    assert set(exact["gather_bytes_fp8"]) == fp8
    assert set(exact["gather_bytes_fp32"]) == fp32
    # Forward and backward gather every unit: 3 x 2 calls per step, one amax all-reduce each.
    assert exact["gather_calls_per_step"] == 6
    assert exact["amax_all_reduces_per_step"] == 6
    assert exact["gather_bytes_per_step_fp8"] == 2 * sum(fp8)
    assert exact["gather_bytes_per_step_fp32"] == 2 * sum(fp32)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_training_equals_fp8_compute_without_fp8_all_gather(report):
    assert report["exact"]["loss_rel_error"] <= 1e-6
    assert report["exact"]["param_rel_error"] <= 1e-6
    assert report["sgd"]["param_rel_error"] <= 1e-6


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_hsdp_with_one_shard_per_replica(report):
    assert report["hsdp"]["forward_weight_exact"]
    assert report["hsdp"]["param_rel_error"] <= 1e-6


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_bf16_param_dtype_gathers_fp32_of_fp8(report):
    bf16 = report["bf16"]
    assert bf16["forward_weight_exact"]
    assert all(math.isfinite(v) for v in bf16["losses"])
    assert "uniform gradient dtype" in bf16["mixed_unit_error"]


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_state_dict_and_dcp(report):
    assert report["state"] == {"state_dict_plain": True, "dcp_round_trip": True}

"""TP / SP building blocks on tp gloo ranks vs the unsharded layers, fp64, norm-relative error <= 1e-12.

One launch per world size runs every case of ``scripts/tp_layers_check.py`` on every TP
layout of that world (all ranks in one tp group; at 4 ranks also tp=2 groups inside a
(dp, tp) and a (tp, dp) mesh, where group ranks differ from global ranks):

- column/row linear pair (f ... g), forward and every gradient, weights gathered back;
- the same pair under sequence parallelism (f* ... g*), seq dim 1 and 0, own chunks;
- fused q|k|v column projections cut per segment (GPT-2 Conv1D (E, E, E), GQA Linear);
- scatter / gather at the ends of the sequence-parallel region, with gradients;
- vocabulary-parallel embedding (with padding_idx) and cross-entropy in loss_parallel_region
  (mean/sum/none, ignore_index, [N, V], [B, T, V] views and slices, [N, C, T], fp32, and
  the gathered fallback for label smoothing and class weights);
- the global gradient norm and clipping over TP-sharded and replicated gradients.
"""

import json
from pathlib import Path

import pytest
from tests_support import run_distributed


SCRIPT = Path(__file__).parents[2] / "scripts" / "tp_layers_check.py"
CASES = {
    "column_row",
    "column_row_sp",
    "fused_qkv",
    "scatter_gather",
    "vocab_embedding",
    "vocab_cross_entropy",
    "grad_norm",
    # ids owned by other ranks must not count as row 0 (scale_grad_by_freq, max_norm)
    "vocab_embedding_options",
    # a mean over zero targets: nan loss as in torch, but a zero gradient, not nan
    "vocab_cross_entropy_all_ignored",
    # fp64 gradients with no TP-sharded one keep an fp64 norm
    "grad_norm_replicated_only",
}



def run_check(tmp_path, nproc, timeout=120):
    out = tmp_path / f"tp_layers_{nproc}.json"
    run_distributed(SCRIPT, nproc, ["--out", str(out)], timeout=timeout).check()
    return json.loads(out.read_text())


def check_report(report, nproc):
    assert report["world"] == nproc
    assert set(report["cases"]) == CASES
    expected = [f"tp={nproc}"] + (["tp=2 inner of (dp, tp)", "tp=2 outer of (tp, dp)"] if nproc == 4 else [])
    assert report["layouts"] == expected


@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_tensor_layers(tmp_path, nproc):
    check_report(run_check(tmp_path, nproc), nproc)


"""Dropout under tensor parallelism: nanoGPT (tests/zoo) with attention and residual dropout 0.1.

With dropout no layout can match one process (a rank's heads draw their masks from its own
share of the stream), so these tests hold what must stay exact:

- every tp rank holds the same norm parameters after training: the residual stream, replicated
  over tp, got the same masks on each rank, also where a callback draws random numbers on rank 0
  only before every step (lightning_5d/parallel/tensor/random_stream.py realigns the stream). A
  rank whose stream drifted would train its copy on other activations than its peers, silently:
  the losses would still agree, since every row projection's all-reduce and the
  vocabulary-parallel loss sum the ranks' parts;
- activation checkpointing's recomputation draws the masks of the forward it recomputes: the
  same losses and parameters as without it;
- a model built on the meta device leaves the random stream where the eager build leaves it, so
  training draws the same masks: the same losses and parameters;
- the dropout is on: the losses differ from the same run with dropout 0.
"""

import json

import pytest
import torch

from tests_support import SCRIPTS, parameter_vector_error, run_distributed

STEPS = 3


def case(dropout=0.1, meta=False, sample_on_rank_zero=False, **strategy):
    return {"strategy": strategy, "meta": meta, "dropout": dropout, "steps": STEPS,
            "sample_on_rank_zero": sample_on_rank_zero}  # fmt: skip


CASES = {
    "tp2": case(tp=2),
    "tp2, no dropout": case(dropout=0.0, tp=2),
    "tp2, activation checkpointing": case(tp=2, activation_checkpointing="full"),
    "tp2 x ZeRO-3, meta build": case(meta=True, tp=2, zero=3),
    "tp2+SP": case(tp=2, sequence_parallel=True),
    "tp2+SP, activation checkpointing": case(tp=2, sequence_parallel=True, activation_checkpointing="full"),
    "tp2, a draw on rank 0 only before every step": case(tp=2, sample_on_rank_zero=True),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dropout") / "results.pt"
    args = ["--cases", json.dumps(list(CASES.values())), "--out", str(out)]
    run_distributed(SCRIPTS / "dropout_cases.py", 2, args, timeout=240).check()
    return dict(zip(CASES, torch.load(out)))


def same_run(a: dict, b: dict) -> None:
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=1e-6, atol=0)
    assert parameter_vector_error(a["params"], b["params"]) <= 1e-6


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_dropout_under_tp_keeps_the_ranks_in_step_and_reproducible(results):
    for name, result in results.items():
        losses, norms = result["losses"], result["norms"]
        assert all(rank == losses[0] for rank in losses) and len(losses[0]) == STEPS, f"{name}: {losses}"
        assert len(norms[0]) == 10  # weight and bias of ln_1 and ln_2 in two blocks, and of ln_f
        for key, value in norms[0].items():
            assert all(torch.equal(rank[key], value) for rank in norms[1:]), f"{name}: {key} differs between tp ranks"
    # Only where a rank drew alone was its stream realigned (rank 1 takes rank 0's before each step).
    assert results["tp2, a draw on rank 0 only before every step"]["realigned"] == [0, STEPS]
    assert all(r["realigned"] == [0, 0] for name, r in results.items() if "rank 0 only" not in name)
    same_run(results["tp2"], results["tp2, activation checkpointing"])
    same_run(results["tp2"], results["tp2 x ZeRO-3, meta build"])
    same_run(results["tp2+SP"], results["tp2+SP, activation checkpointing"])
    on, off = torch.tensor(results["tp2"]["losses"][0]), torch.tensor(results["tp2, no dropout"]["losses"][0])
    assert (on - off).abs().max() > 1e-3

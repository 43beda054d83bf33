"""A user's steps hand Lightning what one process hands it: metrics and predictions.

Under tp the head's logits are a vocabulary-sharded DTensor inside a step (so
``F.cross_entropy`` runs vocabulary-parallel), and so is whatever the step derives from them.
Before, an accuracy logged with ``sync_dist=True`` crashed in Lightning's all-reduce
("c10d.allreduce_.default does not have a sharding strategy registered") at the sanity check
of the first ``fit``, ``self.all_gather`` of predicted tokens likewise, ``logits.argmax(-1)``
on a microbatch of one crashed inside torch, and ``predict`` returned DTensors. Under cp a
value logged with ``reduce_fx="max"`` or ``"sum"`` became the token-weighted mean of the
shards' values: a wrong number, without a word.

Here the steps a user writes for one process (step_edges.py) run under tp, cp and pp layouts on
the reference model and on zoo models written in other styles: every metric and prediction
equals one process's on the same samples, and every value Lightning or a callback sees is a
plain tensor.
"""

import json

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

from step_edges import build, top32_hits
from tests_support import SCRIPTS, cases_through, make_datamodule, run_distributed

TWO_RANKS = {  # name: case (one data rank each: every rank sees the same samples)
    "reference tp2": {"model": "tiny", "layout": {"tp": 2}},
    "reference tp2+sp": {"model": "tiny", "layout": {"tp": 2, "sequence_parallel": True}},
    "nanogpt tp2 (tied head)": {"model": "nanogpt", "layout": {"tp": 2}},
    "HF Qwen3 tp2+sp": {"model": "qwen3", "layout": {"tp": 2, "sequence_parallel": True}},
    "reference cp2": {"model": "tiny", "layout": {"cp": 2}, "predict": False},
    "reference pp2": {"model": "tiny", "layout": {"pp": 2, "pipeline": {"microbatches": 2}}, "gather": False},
}
FOUR_RANKS = {
    # The step runs on the last stage only: no all_gather inside it.
    "reference pp2 x tp2": {"model": "tiny", "layout": {"tp": 2, "pp": 2, "pipeline": {"microbatches": 2}},
                            "gather": False},
    # predict is refused under cp (each rank would return its sequence shard).
    "reference tp2 x cp2": {"model": "tiny", "layout": {"tp": 2, "cp": 2}, "predict": False},
}  # fmt: skip
VAL_BATCHES = 2
BATCH = 2


def one_process(name: str) -> dict:
    """The same steps' numbers in this process: 2 validation batches, 2 predictions, the first training batch."""
    module = build(name)
    datamodule = make_datamodule()
    datamodule.setup("fit")
    val = [default_collate([datamodule.val_dataset[i] for i in range(b * BATCH, (b + 1) * BATCH)])
           for b in range(VAL_BATCHES)]  # fmt: skip
    with torch.no_grad():
        per_batch = []
        for batch in val:
            logits, loss, accuracy = module.metrics(batch)
            per_batch.append({"val_loss": loss, "val_acc": accuracy, "val_top_logit": logits.max(),
                              "val_mean_prob": logits.softmax(-1).amax(-1).mean(),
                              "val_top32": top32_hits(logits, batch["labels"]).mean(),
                              "val_top32_hits": top32_hits(logits, batch["labels"]).sum()})  # fmt: skip
        validate = {k: float(torch.stack([b[k] for b in per_batch]).mean()) for k in per_batch[0]}
        # Logged with reduce_fx "max" and torch.sum:
        validate["val_top_logit"] = max(float(b["val_top_logit"]) for b in per_batch)
        validate["val_top32_hits"] = sum(float(b["val_top32_hits"]) for b in per_batch)
        validate["val_top32_hits_synced"] = validate["val_top32_hits"]
        validate["val_metric_hits"] = validate["val_top32_hits"]  # torchmetrics SumMetric over the batches
        validate["val_metric_acc"] = validate["val_acc"]  # micro accuracy: equal batches, the mean
        validate["val_top32_count"] = validate["val_top32_hits"] / VAL_BATCHES  # the default mean of counts
        validate["val_acc_rank0"] = validate["val_acc"]
        validate["val_samples"] = float(BATCH)
        predict = [module.logits(batch["input_ids"]) for batch in val]
        dataset = datamodule.train_dataset
        first = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0))[:BATCH].tolist()
        batch = default_collate([dataset[i] for i in first])
        logits, loss, accuracy = module.metrics(batch)
    train = {"train_loss": float(loss), "train_acc": float(accuracy),
             "train_top_prob": float(logits.softmax(-1).amax(-1).mean()),
             "train_top32": float(top32_hits(logits, batch["labels"]).mean())}  # fmt: skip
    return {"validate": validate, "predict": predict, "train": train}


def run_cases(tmp_path, cases: dict, nproc: int, timeout: float) -> dict:
    return cases_through("step_edges.py", tmp_path, cases, nproc, timeout=timeout)


def check_case(name: str, case: dict, result: dict) -> None:
    expected = one_process(case["model"])
    assert result["types"] == ["Tensor"], f"{name}: Lightning and callbacks received {result['types']}"
    for key, value in expected["validate"].items():
        assert result["validate"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), f"{name}: {key}"
    assert result["validate"]["val_acc_unsynced"] == pytest.approx(expected["validate"]["val_acc"], abs=1e-6)
    if case.get("gather", True):  # each rank's tokens (under cp: of its sequence shard) from every rank
        world = 4 if name in FOUR_RANKS else 2
        assert result["validate"]["val_gathered_tokens"] == world * BATCH * 32 // case["layout"].get("cp", 1), name
    for key, value in expected["train"].items():
        assert result["train"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), f"{name}: {key}"
    assert result["votes"] == {"any": True, "all": False, "all of True": True}, name
    if case.get("predict", True):
        assert result["predict_types"] == ["Tensor"], name
        for got, logits in zip(result["predict"], expected["predict"], strict=True):
            torch.testing.assert_close(got["logits"], logits, rtol=1e-5, atol=1e-5)
            assert torch.equal(got["tokens"], logits.argmax(-1)), name


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("nproc", [2, 4], ids=["2 ranks", "4 ranks: pp or cp with tp"])
def test_metrics_and_predictions_equal_one_process_as_plain_tensors(tmp_path, nproc):
    cases = TWO_RANKS if nproc == 2 else FOUR_RANKS
    results = run_cases(tmp_path, cases, nproc, timeout=240)
    for name, case in cases.items():
        check_case(name, case, results[name])


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_sync_dist_sums_over_the_data_ranks_only(tmp_path):
    # tp2 x 2 data ranks: rank r reads validation samples r, r+2, r+4, r+6 (Lightning's sampler),
    # 2 batches each. A sum with sync_dist is the 8 samples' total, counted once (not tp times).
    case = {"model": "tiny", "layout": {"tp": 2, "zero": 1}, "predict": False}
    result = run_cases(tmp_path, {"tp2 x dp2": case}, 4, timeout=240)["tp2 x dp2"]
    module = build("tiny")
    datamodule = make_datamodule()
    datamodule.setup("fit")
    samples = default_collate([datamodule.val_dataset[i] for i in range(4 * BATCH)])
    with torch.no_grad():
        logits, _, _ = module.metrics(samples)
    total = float(top32_hits(logits, samples["labels"]).sum())
    assert result["validate"]["val_top32_hits_synced"] == total
    assert result["validate"]["val_metric_hits"] == total  # torchmetrics syncs across tp groups, not within
    assert result["types"] == ["Tensor"]
    assert result["votes"] == {"any": True, "all": False, "all of True": True}


def refused_run(tmp_path, case: dict):
    """One case on 2 ranks that should stop with a refusal: it must not reach the 120 s limit (-9)."""
    args = ["--cases", json.dumps([case]), "--out", str(tmp_path / "r.pt")]
    run = run_distributed(SCRIPTS / "step_edges.py", 2, args, timeout=120)
    assert run.returncode not in (0, -9), run.output[-3000:]
    return run


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_a_rank_zero_only_log_of_a_partial_value_under_tp_is_refused(tmp_path):
    case = {"model": "tiny", "layout": {"tp": 2}, "partial_rank0": True}
    run = refused_run(tmp_path, case)
    assert "TensorParallelError: self.log('val_top_logit_rank0', ..., rank_zero_only=True) under tp" in run.output
    assert "Log it on every rank (without rank_zero_only)" in run.output


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_all_gather_inside_a_pipelined_step_is_refused_on_every_rank(tmp_path):
    # Before, the ranks never met in the gather: the run waited until its time limit.
    case = {"model": "tiny", "layout": {"pp": 2, "pipeline": {"microbatches": 2}}, "gather": True}
    run = refused_run(tmp_path, case)
    assert run.output.count("PipelineError: self.all_gather inside a step under pp") >= 2, run.output[-3000:]
    assert "on_validation_batch_end" in run.output

"""A module fitted again by a new Trainer with a new FiveDStrategy (staged fine-tuning, a notebook's
second ``fit``) keeps the dimensions the first strategy applied, and trains as one process does.

Before, the second strategy applied them again to the cut module: under tp discovery refused it
with a wrong "give the right head counts" (its projections were already cut), under ZeRO-3 it
broadcast FSDP2's DTensors (``NotImplementedError``), under pp a peer was lost. A second strategy
with other settings is refused, naming both layouts. ZeRO-0..2 alone only hook the parameters
and are applied afresh, as before.

One process does the same: 2 steps with one AdamW, then 2 steps on the same first batches (the
new Trainer starts its epoch again) with a new AdamW.
"""

import json

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

from tests_support import MODELS, SCRIPTS, RecordingLM, make_datamodule, parameter_vector_error, run_distributed

STEPS = 2
PIPELINE = {"pp": 2, "pipeline": {"microbatches": 2}}
CASES = {  # name: (first, second, data ranks)
    "tp2": ({"tp": 2}, {"tp": 2}, 1),
    "ZeRO-3": ({"zero": 3}, {"zero": 3}, 2),
    "pp2": (PIPELINE, PIPELINE, 1),
    "ZeRO-1 (applied afresh)": ({"zero": 1}, {"zero": 1}, 2),
    "tp2, then tp2 x ZeRO-3": ({"tp": 2}, {"tp": 2, "zero": 3}, None),
}


def one_process(data_ranks: int, batch_size: int = 2) -> dict:
    L.seed_everything(0, verbose=False)
    model = RecordingLM(config=MODELS["tiny"])
    dm = make_datamodule()
    dm.setup("fit")
    dataset, batch = dm.train_dataset, batch_size * data_ranks
    perm = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0)).tolist()
    for _ in range(2):  # two fits, each with its own optimizer from the epoch's start
        optimizer = model.configure_optimizers()
        for step in range(STEPS):
            optimizer.zero_grad()
            data = default_collate([dataset[i] for i in perm[step * batch : (step + 1) * batch]])
            F.cross_entropy(model(data["input_ids"]).flatten(0, 1), data["labels"].flatten()).backward()
            optimizer.step()
    return model.state_dict()


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_second_trainer_keeps_the_dimensions_and_trains_as_one_process(tmp_path):
    cases = [{"first": first, "second": second, "steps": STEPS} for first, second, _ in CASES.values()]
    out = tmp_path / "results.pt"
    run_distributed(SCRIPTS / "second_trainer.py", 2, ["--cases", json.dumps(cases), "--out", str(out)],
                    timeout=240).check()  # fmt: skip
    results = dict(zip(CASES, torch.load(out)))
    for name, (_, _, data_ranks) in CASES.items():
        if data_ranks is None:
            continue
        assert "params" in results[name], f"{name}: {results[name]}"
        assert parameter_vector_error(results[name]["params"], one_process(data_ranks)) <= 1e-5, name
    error = results["tp2, then tp2 x ZeRO-3"]["error"]
    assert "already parallelized by an earlier FiveDStrategy" in error
    assert "zero=1" in error and "zero=3" in error and "tp=2" in error

"""Ranks that use different parameters, a parameter nobody uses, and manual accumulation,
against the same steps in one process (fp64)."""

import json

import lightning as L
import pytest
import torch
from torch.utils.data import default_collate

from routed_experts import BATCH, Routed, Samples
from tests_support import SCRIPTS, run_distributed

WORLD = 2


def reference(batches: int, manual_accumulate: int):
    """What rank r sees in batch k is perm[(k*B + j)*W + r]; the loss is the mean over ranks."""
    L.seed_everything(0, verbose=False)
    model = Routed(manual_accumulate).double()
    optimizer = model.configure_optimizers()
    data = Samples()
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(0)).tolist()
    accumulate = manual_accumulate or 1
    losses = []
    for k in range(batches):
        per_rank = []
        for r in range(WORLD):
            x, which = default_collate([data[perm[(k * BATCH + j) * WORLD + r]] for j in range(BATCH)])
            per_rank.append(model.loss(x, which))
        loss = torch.stack(per_rank).mean()
        (loss / accumulate).backward()
        losses.append(loss.item())
        if (k + 1) % accumulate == 0:
            optimizer.step()
            optimizer.zero_grad()
    return losses, model.state_dict()


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("zero,manual_accumulate", [(0, 0), pytest.param(1, 0, marks=pytest.mark.slow), pytest.param(2, 0, marks=pytest.mark.slow), pytest.param(1, 2, marks=pytest.mark.slow), (2, 2)])
def test_rank_dependent_and_unused_parameters(tmp_path, zero, manual_accumulate):
    steps = 6
    args = ["--zero", str(zero), "--manual-accumulate", str(manual_accumulate), "--steps", str(steps), "--out", str(tmp_path)]
    run_distributed(SCRIPTS / "routed_experts.py", WORLD, args, timeout=200).check()
    losses = json.loads((tmp_path / "losses.json").read_text())
    params = torch.load(tmp_path / "params.pt")
    batches = steps * (manual_accumulate or 1)  # manual optimization counts optimizer steps too
    ref_losses, ref_params = reference(batches, manual_accumulate)
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), torch.tensor(ref_losses, dtype=torch.float64), rtol=1e-9, atol=0)
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-9, atol=1e-12, msg=lambda m: f"{name}: {m}")
    L.seed_everything(0, verbose=False)
    untouched = Routed().double().state_dict()
    for name in ("experts.2.weight", "experts.2.bias"):
        assert torch.equal(params[name], untouched[name]), f"{name} moved although no rank used it"

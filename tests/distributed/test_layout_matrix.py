"""The layout matrix: Hugging Face Llama, Qwen2, GPT-2 and Mixtral (small configs, built
locally) in the obvious LightningModule, under every pair of layout options.

Options come in groups: data (dp = ZeRO-0, zero1, zero3), tensor (tp, tp+sp), context (cp),
pipeline (pp 1F1B, pp interleaved with 2 virtual stages) and experts (ep, MoE models only).
A cell pairs two options of different groups, each at size 2, on 4 processes; the
processes left over after tp x cp x pp are data ranks, and ep divides dp x cp. One full
combination per model, dp2 x tp2 x pp2 x cp2 on 16 processes (Mixtral with ep=2), is in
the on-demand set. Every cell trains 5 steps in fp32 and is compared with one process on
the same global batches: each step's loss and the parameter vector within 1e-5 relative.
A cell the strategy refuses must be refused with its documented message before any step.

The fast tier runs FAST; the whole matrix is on demand (docs/layout_matrix.md):
    L5D_LAYOUT_MATRIX_OUT=outputs/layout_matrix python -m pytest -m matrix tests/distributed/test_layout_matrix.py
    python tests/distributed/scripts/layout_matrix_table.py outputs/layout_matrix docs/layout_matrix.md
Cells run in batches: one set of processes trains the selected cells one after another
(scripts/layout_matrix_cells.py), so processes start once per batch, not per cell.
"""

import functools
import json
import os
import re
from itertools import combinations
from pathlib import Path

import pytest
import torch

from hf_support import hf_reference_run
from tests_support import SCRIPTS, assert_equivalent, parameter_vector_error, run_distributed

STEPS = 5
MODELS = ("llama", "qwen2", "gpt2", "mixtral")
MOE = ("mixtral",)
GROUPS = {
    "data": {"dp": {"zero": 0}, "zero1": {"zero": 1}, "zero3": {"zero": 3}},
    "tensor": {"tp": {"tp": 2}, "tp+sp": {"tp": 2, "sp": True}},
    "context": {"cp": {"cp": 2}},
    "pipeline": {
        "pp 1f1b": {"pp": 2},
        "pp interleaved": {"pp": 2, "schedule": "interleaved_1f1b", "virtual_stages": 2},
    },
    "experts": {"ep": {"ep": 2}},
}
OPTIONS = {name: options for group in GROUPS.values() for name, options in group.items()}
PAIRS = [(a, b) for g, h in combinations(GROUPS, 2) for a in GROUPS[g] for b in GROUPS[h]]
FULL = "dp2 x tp2 x pp2 x cp2"
# pp2 x 2 virtual stages = 4 stages: 4 layers; 4 sequences per data rank = 4 microbatches
DEFAULTS = dict(tp=1, sp=False, cp=1, zero=1, pp=1, schedule="1f1b", virtual_stages=1, microbatches=None, ep=1,
                layers=4, batch_size=4, steps=STEPS)  # fmt: skip
REFUSALS = (  # (applies to the cell, the message the strategy must give), the first that applies
    # GPT-2's head is its token embedding (tie_word_embeddings=True), needed by the first and last stage
    (lambda c: c["model"] == "gpt2" and c["pp"] > 1, "(tied embeddings): the first and last pipeline stages"),
    # the module passes labels= to GPT-2, whose own loss shifts them inside each sequence shard
    (lambda c: c["model"] == "gpt2" and c["cp"] > 1, "was called with labels=: Hugging Face's own loss shifts"),
    (lambda c: c["ep"] > 1 and c["sp"], "ep > 1 with sequence_parallel=true is not supported yet"),
)


def make_cell(model: str, pair: str, nproc: int, **options) -> dict:
    cell = {**DEFAULTS, **options, "model": model, "pair": pair, "nproc": nproc}
    if cell["pp"] > 1:
        cell["microbatches"] = cell["batch_size"]
    cell["id"] = re.sub(r"[^a-z0-9+]+", "_", f"{model} {pair}")
    return cell


def pair_cells(model: str) -> list[dict]:
    return [
        make_cell(model, f"{a} x {b}", 4, **OPTIONS[a], **OPTIONS[b])
        for a, b in PAIRS
        if model in MOE or "ep" not in (a, b)
    ]


def full_cell(model: str) -> dict:
    return make_cell(model, FULL, 16, tp=2, cp=2, pp=2, **({"ep": 2} if model in MOE else {}))


def expected_refusal(cell: dict) -> str | None:
    return next((message for applies, message in REFUSALS if applies(cell)), None)


MATRIX = [cell for model in MODELS for cell in pair_cells(model)] + [full_cell(model) for model in MODELS]
BY_ID = {cell["id"]: cell for cell in MATRIX}
# Not covered by the other Hugging Face tests' fast tier: ZeRO-3 under tp+sp, sequence parallelism
# inside pipeline stages (later stages build rotary positions from a placeholder embedding output),
# experts inside context-parallel ranks, and a refusal raised at the first forward.
FAST = ["qwen2_zero3_x_tp+sp", "llama_tp+sp_x_pp_interleaved", "mixtral_cp_x_ep", "gpt2_tp+sp_x_cp"]


MAX_BATCH = 32  # cells per set of processes: bounds the wait for a batch that hangs


@functools.lru_cache(maxsize=None)
def reference(model: str, data_ranks: int, layers: int, batch_size: int):
    return hf_reference_run(model, STEPS, data_ranks, layers=layers, batch_size=batch_size)


class Batches:
    """Runs the selected cells of one process count together, from the first one asked for.

    A cell without a result (its batch failed at or before it) starts a new batch from itself,
    so a failing cell fails alone and the rest still run."""

    def __init__(self, root: Path):
        self.root = root

    def result(self, cell: dict, selected: list[dict]) -> dict:
        path = self.root / cell["id"] / "result.json"
        if not path.exists():
            start = selected.index(cell)
            batch = [c for c in selected[start:] if c["nproc"] == cell["nproc"]]
            batch = [c for c in batch if not (self.root / c["id"] / "result.json").exists()][:MAX_BATCH]
            cells = self.root / f"cells_{cell['id']}.json"
            cells.write_text(json.dumps(batch))
            args = ["--cells", str(cells), "--out", str(self.root)]
            timeout = 60 + 20 * cell["nproc"] * len(batch)  # a bound for hangs: cells take 3-15 s at 4 processes
            run = run_distributed(SCRIPTS / "layout_matrix_cells.py", cell["nproc"], args, timeout=timeout)
            (self.root / f"output_{cell['id']}.txt").write_text(run.output)
            if not path.exists():
                run.check()
                raise AssertionError(f"the batch ended without a result for {cell['id']}:\n{run.output[-6000:]}")
        return json.loads(path.read_text())


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    return Batches(tmp_path_factory.mktemp("layout_matrix"))


def record(cell: dict, outcome: dict) -> None:
    """The cell's outcome for docs/layout_matrix.md (scripts/layout_matrix_table.py)."""
    root = os.environ.get("L5D_LAYOUT_MATRIX_OUT")
    if root:
        Path(root).mkdir(parents=True, exist_ok=True)
        keys = ("model", "pair", "nproc", "tp", "sp", "cp", "zero", "pp", "schedule", "ep")
        outcome = {**{k: cell[k] for k in keys}, **outcome}
        (Path(root) / f"{cell['id']}.json").write_text(json.dumps(outcome, indent=1))


def check_cell(request, batches: Batches, cell_id: str) -> None:
    pytest.importorskip("transformers")
    cell = BY_ID[cell_id]
    # -k or -m may have left out some cells: a batch holds only the cells this session runs.
    ids = [getattr(item, "callspec", None) and item.callspec.params.get("cell_id") for item in request.session.items]
    selected = [BY_ID[i] for i in ids if i in BY_ID]
    try:
        result = batches.result(cell, selected)
        refusal = expected_refusal(cell)
        if refusal is not None:
            assert "refused" in result, f"{cell_id} trained; expected the refusal '{refusal}'"
            assert refusal in result["refused"] and result["steps_run"] == 0, result
            record(cell, {"status": "refused", "reason": result["refused"]})
            return
        assert "refused" not in result, f"{cell_id} was refused: {result.get('refused')}"
        data_ranks = cell["nproc"] // (cell["tp"] * cell["cp"] * cell["pp"])
        ref_losses, ref_params = reference(cell["model"], data_ranks, cell["layers"], cell["batch_size"])
        params = torch.load(batches.root / cell["id"] / "params.pt")
        losses = torch.tensor(result["losses"], dtype=torch.float64)
        loss_error = float(((losses - torch.tensor(ref_losses)).abs() / torch.tensor(ref_losses).abs()).max())
        outcome = {"loss_error": loss_error, "param_error": parameter_vector_error(params, ref_params),
                   "seconds": result["seconds"]}  # fmt: skip
        assert_equivalent(result["losses"], params, ref_losses, ref_params)
        record(cell, {"status": "pass", **outcome})
    except BaseException as error:
        record(cell, {"status": "fail", "reason": f"{type(error).__name__}: {str(error)[:2000]}"})
        raise


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("cell_id", FAST)
def test_layout_cell(request, batches, cell_id):
    check_cell(request, batches, cell_id)


@pytest.mark.distributed
@pytest.mark.matrix
@pytest.mark.timeout(3600)  # the first cell of a batch runs the whole batch
@pytest.mark.parametrize("cell_id", list(BY_ID))
def test_layout_matrix(request, batches, cell_id):
    check_cell(request, batches, cell_id)

"""The zoo matrix as tests: models written in other styles than this project's own tests
(tests/zoo) under zero3, tp2, tp2+sp, cp2, pp2, fp8, tp2 x pp2 and tp2+sp x cp2 x pp2,
each against one process (scripts/zoo_matrix.py says how cells are run and judged).

The fast tier runs FAST: cells that pass today, all on 2 processes, trained in one launch.
The whole matrix is on demand (`-m extended`): a cell passes the test when it trains to the
single-process losses and parameters, or is refused by lightning_5d before it can train
wrongly; a wrong loss or a crash fails it. docs/layout_matrix.md holds the recorded table.
"""

import pytest

from zoo_matrix import BY_ID, outcome_of, run_cells

# Four models of four styles under four layouts, each passing today, all on 2 processes (one launch):
FAST = [
    "kwargs_forward__tp2psp",  # hand-written, keyword-only forwards, q/k/v biases: tp + sequence parallelism
    "phi3__cp2",  # Hugging Face Phi-3 (fused qkv_proj and gate_up_proj): context parallelism
    "torch_encoder__zero3",  # nn.TransformerEncoder / nn.MultiheadAttention: ZeRO-3
    "olmo2__pp2",  # Hugging Face OLMo-2 (full-width q/k norms, post-norms): pipeline parallelism
]


@pytest.fixture(scope="module")
def zoo_run(request, tmp_path_factory):
    """Trains this session's selected cells on first use (one launch per process count)."""
    root = tmp_path_factory.mktemp("zoo_matrix")
    ids = [getattr(item, "callspec", None) and item.callspec.params.get("cell_id") for item in request.session.items]
    selected = [BY_ID[i] for i in dict.fromkeys(ids) if i in BY_ID]
    started = []

    def outcome(cell_id: str) -> dict:
        if not started:
            started.append(True)
            run_cells(selected, root)
        return outcome_of(BY_ID[cell_id], root)

    return outcome


def describe(outcome: dict) -> str:
    return f"{outcome['id']}: {outcome['status']}: {outcome.get('reason', '')}\n{outcome.get('message', '')[:3000]}"


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("cell_id", FAST)
def test_zoo_cell(zoo_run, cell_id):
    pytest.importorskip("transformers")
    outcome = zoo_run(cell_id)
    assert outcome["status"] == "pass", describe(outcome)


@pytest.mark.distributed
@pytest.mark.extended
@pytest.mark.timeout(5400)  # the first cell runs the whole selection
@pytest.mark.parametrize("cell_id", list(BY_ID))
def test_zoo_matrix(zoo_run, cell_id):
    pytest.importorskip("transformers")
    outcome = zoo_run(cell_id)
    assert outcome["status"] in ("pass", "refused"), describe(outcome)

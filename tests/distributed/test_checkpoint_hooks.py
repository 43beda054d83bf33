"""Lightning's weight averaging and a module's checkpoint hooks give one process's numbers through a resume, or a refusal.

Before, the sharded checkpoint handed Lightning's load hooks a stand-in for the model's tensors
without ``.items()``: a module's ``on_load_checkpoint`` that renames keys, and Lightning's
``WeightAveraging`` on every resume (also on one process), failed with ``AttributeError:
'StoredState' object has no attribute 'items'``. Under tp2, pp2 and ZeRO-3 ``WeightAveraging``
failed inside torch's ``AveragedModel`` at its first update (a size mismatch, or "got mixed
torch.Tensor and DTensor"), after its setup had deep-copied the whole model on every rank.

Now the stored model state reads as a dict (each tensor whole, on access, by the asking rank
alone), a replacement dict is loaded instead, and the averaging callbacks are refused before
their setup where a rank's module holds pieces (lightning_5d.parameter_reads).
"""


import pytest

from tests_support import cases_through, parameter_vector_error

TP2, PP2 = {"tp": 2}, {"pp": 2, "pipeline": {"microbatches": 2}}
SAME = {  # name: (case, the one-process case it must match)
    "dp2 zero=1: EMA": ({"layout": {"zero": 1}, "hook": "ema"}, "ema b4"),
    "cp2: EMA": ({"layout": {"cp": 2}, "hook": "ema"}, "ema b2"),
    "tp2: keys renamed by the load hook": ({"layout": TP2, "hook": "renamed"}, "renamed b2"),
    "tp2: a stored tensor read by rank 0's load hook": ({"layout": TP2, "hook": "inspect"}, "inspect b2"),
}
REFUSED = {
    "tp2: EMA": {"layout": TP2, "hook": "ema"},
    "pp2: EMA": {"layout": PP2, "hook": "ema"},
    "dp2 zero=3: EMA": {"layout": {"zero": 3}, "hook": "ema"},
}
ONE_PROCESS = {
    "ema b4": {"layout": {}, "hook": "ema", "batch": 4},
    "ema b2": {"layout": {}, "hook": "ema"},
    "renamed b2": {"layout": {}, "hook": "renamed"},
    "inspect b2": {"layout": {}, "hook": "inspect"},
}


def run_cases(tmp_path, cases: dict, nproc: int) -> dict:
    cases = {name: {**case, "root": str(tmp_path / f"{nproc}-{i}")} for i, (name, case) in enumerate(cases.items())}
    return cases_through("checkpoint_hooks.py", tmp_path, cases, nproc, timeout=360)


@pytest.mark.distributed
@pytest.mark.timeout(480)
def test_averaging_and_load_hooks_through_a_resume(tmp_path):
    one = run_cases(tmp_path, ONE_PROCESS, 1)
    results = run_cases(tmp_path, {**{k: c for k, (c, _) in SAME.items()}, **REFUSED}, 2)
    for name, (_, reference) in SAME.items():
        assert "error" not in results[name], results[name].get("error")
        assert parameter_vector_error(results[name]["params"], one[reference]["params"]) <= 1e-5, name
    seen, expected = results["tp2: a stored tensor read by rank 0's load hook"]["seen"], one["inspect b2"]["seen"]
    assert seen["keys"] == expected["keys"] == 21 and seen["norm"] == pytest.approx(expected["norm"], rel=1e-6)
    # The renamed keys really were loaded: the resumed module started from other weights (seed 1).
    assert parameter_vector_error(one["renamed b2"]["params"], one["ema b2"]["params"]) > 1e-3
    for name in REFUSED:
        error = results[name].get("error", "")
        assert "WeightAveraging keeps a whole copy" in error and "zero=0/1/2, cp" in error, f"{name}: {error!r}"

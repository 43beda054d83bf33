"""A step's cross-entropy on labels with -100 spread unevenly is one process's mean over the batch's tokens.

Before, data ranks and pipeline microbatches each took the mean of their own targets and the
layout averaged those means, which is the batch's mean only when every part counts the same
targets. On SFT-style data (sample i's first 7i mod 29 targets masked) that trained silently
away from one process, after 3 steps (parameter vector error): dp2 2.2e-2 (also under ZeRO-3),
pp2 1.2e-2 (labels shifted in the step: 1.3e-2; with accumulation 1.1e-2), pp2 x dp2 3.9e-2,
cp2 x dp2 and tp2 x dp2 2.3e-2; Hugging Face's Qwen3 computing its loss from ``labels=``
3.5e-3 under pp2 and 7.3e-3 under dp2, and pp2's logged val_loss was 4.8412 for one process's
4.8392. Now each matches one process within 1e-5, logged losses included, and targets masked
inside the step, which pp cannot count before its microbatches run, are refused
(lightning_5d.parallel.token_mean). A cross-entropy summed and divided by the step's own count
is left as it was (exact where the parts count the same targets); under cp it was summed over the
sequence first, which made it twice the mean at cp2 (1.5e-2 off, logged 10.12 for 5.25): now the
shard's own, like a data rank's.
"""

import math

import pytest

from tests_support import cases_through, parameter_vector_error

PP2 = {"pp": 2, "pipeline": {"microbatches": 2}}
ONE_PROCESS = {
    "b4": {"layout": {}, "batch": 4, "validate": True},
    "b4 shifted": {"layout": {}, "batch": 4, "labels": "shifted"},
    "b4 sum": {"layout": {}, "batch": 4, "reduction": "sum", "labels": "unmasked"},
    "b4 accumulate 2": {"layout": {}, "batch": 4, "accumulate": 2},
    "b8": {"layout": {}, "batch": 8},
    "qwen3 b4": {"layout": {}, "batch": 4, "model": "qwen3"},
}
TWO_RANKS = {  # name: (case, the one-process case it must match)
    "dp2": ({"layout": {"zero": 1}, "batch": 2}, "b4"),
    "dp2, targets masked in the step": ({"layout": {"zero": 1}, "batch": 2, "labels": "in_step"}, "b4"),
    "dp2 zero=3": ({"layout": {"zero": 3}, "batch": 2}, "b4"),
    # The sum divided by the step's own count is the part's own mean, as before (exact without masking).
    "dp2, a sum over the own count (SGD)": ({"layout": {"zero": 2}, "batch": 2, "reduction": "sum",
                                            "labels": "unmasked"}, "b4 sum"),
    "pp2, then validate": ({"layout": PP2, "batch": 4, "validate": True}, "b4"),
    "pp2, labels shifted in the step": ({"layout": PP2, "batch": 4, "labels": "shifted"}, "b4 shifted"),
    "pp2, a sum over the own count (SGD)": ({"layout": PP2, "batch": 4, "reduction": "sum", "labels": "unmasked"},
                                            "b4 sum"),
    # Before, cp summed a sum over the sequence: divided by the shard's count, twice the mean (1.5e-2 off).
    "cp2, a sum over the own count (SGD)": ({"layout": {"cp": 2}, "batch": 4, "reduction": "sum",
                                            "labels": "unmasked"}, "b4 sum"),
    "pp2, 4 microbatches of one sample": ({"layout": {"pp": 2, "pipeline": {"microbatches": 4}}, "batch": 4}, "b4"),
    "pp2, accumulate 2": ({"layout": PP2, "batch": 4, "accumulate": 2}, "b4 accumulate 2"),
    "cp2, then validate": ({"layout": {"cp": 2}, "batch": 4, "validate": True}, "b4"),
    # Hugging Face's loss from labels= inside the model: it shifts them and takes their mean itself.
    "HF Qwen3, pp2": ({"layout": PP2, "batch": 4, "model": "qwen3"}, "qwen3 b4"),
    "HF Qwen3, dp2": ({"layout": {"zero": 1}, "batch": 2, "model": "qwen3"}, "qwen3 b4"),
}
FOUR_RANKS = {
    "pp2 x dp2": ({"layout": {**PP2, "zero": 1}, "batch": 4}, "b8"),
    "cp2 x dp2": ({"layout": {"cp": 2, "zero": 1}, "batch": 4}, "b8"),
}
FOUR_RANKS_SLOW = {
    "pp2 x cp2": ({"layout": {**PP2, "cp": 2}, "batch": 4}, "b4"),
    "tp2 x dp2": ({"layout": {"tp": 2, "zero": 1}, "batch": 4}, "b8"),
    "pp2 x dp2 zero=3": ({"layout": {**PP2, "zero": 3}, "batch": 4}, "b8"),
}
REFUSED = {"pp2, targets masked in the step": {"layout": PP2, "batch": 4, "labels": "in_step"}}


def run_cases(tmp_path, cases: dict, nproc: int) -> dict:
    return cases_through("token_mean.py", tmp_path, cases, nproc)


def check_equal(results: dict, cases: dict, one: dict) -> None:
    for name, (case, reference) in cases.items():
        assert "error" not in results[name], f"{name}: {results[name].get('error')}"
        error = parameter_vector_error(results[name]["params"], one[reference]["params"])
        assert error <= 1e-5, f"{name}: {error:.2e} from one process"
        own = case.get("reduction") == "sum"  # the step's value is its part's own mean, as before
        if own and "cp" not in case["layout"]:  # ... which Lightning logs on each data rank
            continue
        if results[name]["losses"] and not own:  # pp: the last stage's; every other layout's logged loss is the batch's
            for got, expected in zip(results[name]["losses"], one[reference]["losses"]):
                assert abs(got - expected) <= 1e-5 * abs(expected), f"{name}: loss {got} for {expected}"
        logged, expected = results[name].get("logged", math.nan), one[reference].get("logged", math.nan)
        if not math.isnan(expected):  # the step's logged train_loss: the batch's mean on every layout
            assert abs(logged - expected) <= 1e-5 * abs(expected), f"{name}: logged {logged} for {expected}"
        if "val_loss" in results[name]:
            assert abs(results[name]["val_loss"] - one[reference]["val_loss"]) <= 1e-5, name


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_uneven_targets_give_one_process_numbers(tmp_path):
    one = run_cases(tmp_path, ONE_PROCESS, 1)
    two = run_cases(tmp_path, {**{k: c for k, (c, _) in TWO_RANKS.items()}, **REFUSED}, 2)
    check_equal(two, TWO_RANKS, one)
    for name in REFUSED:
        error = two[name].get("error", "")
        for words in ("TokenMeanError", "pipeline microbatch 1 of 2", "instead of masking targets inside the step"):
            assert words in error, f"{name}: {words!r} not in {error!r}"
    check_equal(run_cases(tmp_path, {k: c for k, (c, _) in FOUR_RANKS.items()}, 4), FOUR_RANKS, one)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_uneven_targets_under_more_compositions(tmp_path):
    one = run_cases(tmp_path, {"b4": ONE_PROCESS["b4"], "b8": ONE_PROCESS["b8"]}, 1)
    check_equal(run_cases(tmp_path, {k: c for k, (c, _) in FOUR_RANKS_SLOW.items()}, 4), FOUR_RANKS_SLOW, one)

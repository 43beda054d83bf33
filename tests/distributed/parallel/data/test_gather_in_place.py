"""ZeRO-3's in-place gather of one-parameter units (parallel/data/gather_in_place.py) against FSDP2's own.

Bit-equal training (losses and every final parameter) with and without it, and the peak of
gathering one 64 MiB single-tensor unit: FSDP2's gather holds it twice (its flat all-gather
buffer, or gloo's temporary, plus the parameter), the in-place one once. The ratio of the two
peaks is measured side by side in one run (tests/distributed/scripts/gather_in_place_check.py).
"""

import json

import pytest

from tests_support import SCRIPTS, run_distributed


def checked(tmp_path, nproc, cases):
    out = tmp_path / "result.json"
    run_distributed(SCRIPTS / "gather_in_place_check.py", nproc, ["--cases", ",".join(cases), "--out", str(out)],
                    timeout=240, env={"OMP_NUM_THREADS": "1"}).check()  # fmt: skip
    result = json.loads(out.read_text())
    for case in cases:
        if case in ("zero3", "bf16", "tp2"):
            default, in_place = result[case]["default"], result[case]["in_place"]
            assert default["in_place"] == 0 and in_place["in_place"] > 0, case  # it ran, where it should
            assert in_place["losses"] == default["losses"], case
            assert in_place["params"].keys() == default["params"].keys()
            for name, values in default["params"].items():
                assert in_place["params"][name] == values, f"{case}: {name}"
        elif case == "async":
            assert result[case]["in_place"]["in_place"] == 2
            assert result[case]["in_place"]["equal_to_full"] == [True, True]
            assert result[case]["default"]["equal_to_full"] == [True, True]
    return result


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_in_place_gather_trains_bit_equal_and_holds_the_unit_once(tmp_path):
    result = checked(tmp_path, 2, ["zero3", "bf16", "async", "memory"])
    for rank in result["memory"]["ranks"]:
        # FSDP2's own: 2 x 64 MiB; in place: 1 x 64 MiB (+ pages of bookkeeping).
        assert rank["in_place"] / rank["default"] < 0.6, rank


@pytest.mark.distributed
@pytest.mark.extended
@pytest.mark.timeout(300)
def test_in_place_gather_under_tp_and_on_four_ranks(tmp_path):
    """tp2 x ZeRO-3 (DTensor weights on a 2-D mesh, regathered in backward with explicit prefetch),
    and ZeRO-3 over 4 ranks (the odd vocabulary pads the embedding's and head's shards)."""
    checked(tmp_path, 4, ["tp2", "zero3", "async"])

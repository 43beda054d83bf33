"""Ring, all-gather and all-to-all (Ulysses) attention on cp ranks vs full SDPA on the gathered sequence.

One launch per world size checks every combination (mode × causal × zig-zag × GQA ×
dtype, and ring / all-gather with an ALiBi bias) inside the script, forward and backward,
against an fp64 SDPA reference; errors
are norm-relative over the whole sequence. The fast tier runs cp=2 once.
"""

import json

import pytest

from pathlib import Path
from tests_support import run_distributed

SCRIPT = Path(__file__).parents[2] / "scripts" / "ring_attention_check.py"
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


def run_check(tmp_path, cp, dtypes=("float32", "bfloat16"), seq=None, timeout=150):
    out = tmp_path / f"ring_cp{cp}.json"
    args = [str(out), "--dtypes", ",".join(dtypes)] + (["--seq", str(seq)] if seq else [])
    run_distributed(SCRIPT, cp, args, timeout=timeout).check()
    return json.loads(out.read_text())


def check_records(records, cp):
    keys = {(r["dtype"], r["mode"], r["causal"], r["zigzag"], r["hkv"], r["bias"]) for r in records}
    assert len(records) == len(keys)
    # ALiBi (issue 22) in ring and all-gather: causal m·(j − i) and the symmetric −m·|i − j|, both shardings
    biased = {(r["mode"], r["bias"], r["causal"], r["zigzag"]) for r in records if r["bias"]}
    assert {(m, b, c) for m, b, c, _ in biased} == {
        (m, b, c) for m in ("ring", "allgather") for b, c in (("key_minus_query", True), ("negative_absolute", False))
    }
    assert {z for *_, z in biased} == {False, True}
    hq = records[0]["hq"]
    expected = {"ring", "allgather"} | ({"alltoall"} if hq % cp == 0 else set()) | ({"hybrid"} if cp >= 4 else set())
    assert {r["mode"] for r in records} == expected
    assert any(r["hkv"] < r["hq"] for r in records)  # GQA covered
    for r in records:
        for name, error in r["errors"].items():
            assert error <= TOLERANCE[r["dtype"]], f"{r}: {name} relative error {error:.2e}"
        if r["mode"] == "alltoall":
            continue  # no ring blocks: the work units below are the ring's
        if r["mode"] == "hybrid":  # a ring over cp/2 groups, each block twice as long: the same work units
            cp_ring = cp // 2
            forward = [u["forward_units"] for u in r["units"]]
            assert forward == [u["backward_units"] for u in r["units"]]
            if not r["causal"]:
                assert forward == [4 * cp_ring] * cp
            elif r["zigzag"]:
                assert forward == [4 + 2 * (cp_ring - 1)] * cp
            continue
        if r["mode"] == "ring" and cp > 1:  # the overlap left over is measured on every rank
            assert all(u["forward_recv_wait_s"] >= 0 and u["backward_recv_wait_s"] >= 0 for u in r["units"])
        forward = [u["forward_units"] for u in r["units"]]
        backward = [u["backward_units"] for u in r["units"]]
        assert forward == backward
        if not r["causal"]:
            assert forward == [4 * cp] * cp
        elif r["zigzag"]:  # balanced: the diagonal block plus a half block per other rank
            assert forward == [4 + 2 * (cp - 1)] * cp
        else:  # plain causal ring: rank r computes r + 1 blocks
            assert forward == [4 * (rank + 1) for rank in range(cp)]
            assert len(set(forward)) == cp


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_ring_attention_cp2(tmp_path):
    check_records(run_check(tmp_path, 2), 2)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_ring_attention_cp4(tmp_path):
    check_records(run_check(tmp_path, 4), 4)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ring_attention_cp8(tmp_path):
    check_records(run_check(tmp_path, 8, timeout=350), 8)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_error_does_not_grow_with_cp(tmp_path):
    """Fixed global sequence; the worst error at each cp stays within 2x of the cp=1 error."""
    worst = {}
    for cp in (1, 2, 4, 8):
        records = run_check(tmp_path, cp, seq=64, timeout=350)
        check_records(records, cp)
        for r in records:
            for name, error in r["errors"].items():
                key = (r["dtype"], name)
                worst.setdefault(key, {})[cp] = max(worst.get(key, {}).get(cp, 0.0), error)
    for key, by_cp in worst.items():
        for cp in (2, 4, 8):
            assert by_cp[cp] <= 2 * by_cp[1], f"{key}: error grows with cp: {by_cp}"

"""The capacity benchmark's search: the boundary it reports is one it measured, from either side."""

from __future__ import annotations

import pytest

from benchmarks import context_parallel_capacity as capacity

MIB = 2**20


def fake_probe(base_mib: float, mib_per_token: float, curve: float = 0.0):
    """A probe whose growth is base + slope·S (+ curve·S², so the linear fit misses), recording each S run."""
    runs: list[tuple[int, int]] = []

    def probe(cp: int, seq_len: int, cap_mib: int = capacity.CAP_MIB) -> dict:
        runs.append((cp, seq_len))
        growth = (base_mib + mib_per_token * seq_len + curve * seq_len**2) * MIB
        return {"seq_len": seq_len, "growth_bytes": growth, "growth_ranks": [growth] * cp, "peak_rss_bytes": growth,
                "step_s": 0.0, "loss": 0.0, "fits": growth <= cap_mib * MIB}  # fmt: skip

    return probe, runs


def true_boundary(fits) -> int:
    s = capacity.GRID
    while fits(s + capacity.GRID):
        s += capacity.GRID
    return s


@pytest.mark.parametrize("curve", [0.0, 2e-6, -2e-6], ids=["linear", "fit_overshoots", "fit_undershoots"])
def test_search_reports_the_measured_boundary(monkeypatch, curve):
    probe, runs = fake_probe(40.0, 0.05, curve)
    monkeypatch.setattr(capacity, "_probe", probe)
    row = capacity._search(1, capacity.CAP_MIB)
    searched = list(runs)
    expected = true_boundary(lambda s: probe(1, s)["fits"])
    assert row["s_max"] == expected and row["converged"]
    measured = {p["seq_len"]: p["fits"] for p in row["probes"]}
    assert measured[expected] and not measured[expected + capacity.GRID]  # both sides were run
    assert len(searched) == len(set(searched))  # no S is run twice


def test_markdown_states_the_ratio_to_cp1(monkeypatch):
    rows = {}
    for cp in capacity.CPS:
        probe, _ = fake_probe(40.0, 0.05 / cp)
        monkeypatch.setattr(capacity, "_probe", probe)
        rows[str(cp)] = capacity._search(cp, capacity.CAP_MIB)
    result = {"model": capacity.MODEL, "cap_mib": capacity.CAP_MIB, "grid": capacity.GRID, "rows": rows,
              "load_1min": [1.0, 1.0]}  # fmt: skip
    text = capacity.markdown(result)
    one = rows["1"]["s_max"]
    for cp in capacity.CPS:
        assert f"| {cp} | {cp} | {rows[str(cp)]['s_max']:,} | {rows[str(cp)]['s_max'] / one:.2f} |" in text

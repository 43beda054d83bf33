"""What the charts show (chart_data.py): verdicts against the GPU and where layouts lose time - data, not pixels."""

import pytest

from lightning_5d.estimate import Cluster, estimate, plan
from lightning_5d.estimate.chart_data import (
    MEMORY_PARTS,
    Limits,
    MemoryVerdict,
    memory_rows,
    memory_warning,
    time_rows,
)

LIMITS = Limits.of(72, 0.1)  # usable 64.8 GiB


@pytest.fixture(scope="module")
def three():
    """8B on 8 GPUs, seq 4096: ZeRO-3 (40.7 GiB, fits), ZeRO-1 mbs 1 (69.5 > usable 64.8), mbs 2 (94 > 72)."""
    ests = [
        estimate("llama3-8b", dp_shard=8, zero=3, seq_len=4096, micro_batch_size=1),
        estimate("llama3-8b", dp_shard=8, zero=1, seq_len=4096, micro_batch_size=1),
        estimate("llama3-8b", dp_shard=8, zero=1, seq_len=4096, micro_batch_size=2),
    ]
    return memory_rows(ests, ["z3", "z1", "z1 mbs2"], LIMITS)


def test_usable_memory_is_the_gpu_less_the_headroom():
    assert LIMITS.capacity_gib == 72 and LIMITS.usable_gib == pytest.approx(64.8)
    assert Limits.of(None, 0.1).verdict(1e9) == MemoryVerdict.FITS  # no GPU given: nothing to judge against


def test_each_row_is_judged_against_capacity_and_usable_memory(three):
    fits, tight, over = three
    assert fits.verdict == MemoryVerdict.FITS and fits.warning == ""
    assert 64.8 < tight.total_gib <= 72 and tight.verdict == MemoryVerdict.OVER_USABLE
    assert over.total_gib > 72 and over.verdict == MemoryVerdict.OVER_CAPACITY
    assert over.warning == f"{over.total_gib:.1f} GiB: does NOT fit"
    for row in three:
        assert list(row.parts_gib) == list(MEMORY_PARTS)
        assert sum(row.parts_gib.values()) == pytest.approx(row.total_gib, abs=0.01)


def test_warning_names_the_worst_row_and_the_gpu(three):
    text = memory_warning(three, LIMITS)
    assert text.startswith("WARNING: 1 of 3 layouts need") and f"{three[2].total_gib:.1f} GiB" in text
    assert "GPU's 72 GiB" in text
    assert memory_warning(three[:2], LIMITS).startswith("WARNING: 1 of 2 layouts use more than the usable 64.8 GiB")
    assert memory_warning(three[:1], LIMITS) == ""


def test_time_rows_split_what_a_step_spends_beyond_ideal_compute():
    entries = plan("l5d-tiny", Cluster(gpus=4), seq_len=256, global_batch=16, top=3)
    for row, e in zip(time_rows(entries, ["a", "b", "c"]), entries, strict=True):
        assert row.ideal_s + sum(row.parts_s.values()) == pytest.approx(e.time.total)
        assert all(v >= -1e-12 for v in row.parts_s.values())
        assert row.mfu == e.time.predicted_mfu

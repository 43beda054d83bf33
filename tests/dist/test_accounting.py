"""Bytes each rank holds for params / grads / optimizer states follow the ZeRO accounting.

fp32 training with AdamW (two fp32 states): 4Ψ + 4Ψ + 8Ψ per rank at ZeRO-0, divided as
each stage prescribes over N data ranks. Measured right before the second optimizer step.
"""

import pytest

from tests_support import TINY, RecordingLM, run_layout

N = 4
TOLERANCE = 0.02


def expected_bytes(zero: int, psi: int, n: int) -> dict[str, float]:
    params, grads, optimizer = 4 * psi, 4 * psi, 8 * psi
    return {
        "params": params / n if zero >= 3 else params,
        "grads": grads / n if zero >= 2 else grads,
        "optimizer": optimizer / n if zero >= 1 else optimizer,
    }


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_model_state_bytes_per_rank_follow_zero(tmp_path, zero):
    psi = sum(p.numel() for p in RecordingLM(config=TINY).parameters())
    result, _ = run_layout(tmp_path, N, zero, steps=2)
    want = expected_bytes(zero, psi, N)
    for rank, measured in enumerate(result["model_state_bytes"]):
        for kind, value in want.items():
            assert abs(measured[kind] - value) <= TOLERANCE * value, (rank, kind, measured[kind], value)

"""The probe's refusals: what a failed probe forward says (no processes)."""

import pytest
import torch
from torch import nn

from lightning_5d.verify.probe import ProbeError, run_probe


class BufferedPositions(nn.Module):
    """nn.TransformerEncoder tutorial style: a float32 sinusoidal table added to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.register_buffer("pe", torch.randn(4, 8))
        self.norm = nn.LayerNorm(8)

    def forward(self, ids):
        return self.norm(self.embed(ids) + self.pe[: ids.size(1)])


def bf16_forward(module):
    def forward(batch):
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            module(batch["input_ids"])

    return forward


def test_mixed_dtype_on_cpu_names_the_float32_buffer_and_a_fix_that_works():
    module = BufferedPositions()
    for p in module.parameters():  # as FiveDPrecision.cast_parameters does: parameters, not buffers
        p.data = p.data.bfloat16()
    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long)}
    with pytest.raises(ProbeError) as raised:
        run_probe(module, batch, bf16_forward(module))
    message = str(raised.value)
    assert "mixed dtype (CPU)" in message and "(pe)" in message, message
    assert ".to(x.dtype)" in message and "verify='off'" not in message, message
    # The advice works: the buffer in the activations' dtype.
    module.pe = module.pe.bfloat16()
    run_probe(module, batch, bf16_forward(module))


def test_other_probe_failures_keep_the_general_advice():
    module = nn.Linear(3, 3)
    with pytest.raises(ProbeError, match="verify='off'"):
        run_probe(module, {"input_ids": torch.zeros(1, 4, dtype=torch.long)}, lambda b: module(b["input_ids"]))


def test_a_refusal_met_in_the_probe_forward_keeps_its_own_advice():
    from lightning_5d.parallel.tensor.packed_attention import local_heads_forward

    attention = nn.MultiheadAttention(8, 2, batch_first=True)
    attention.forward = local_heads_forward(attention, rank=0, tp=1)
    x = torch.zeros(1, 4, 8)
    with pytest.raises(ProbeError) as raised:
        run_probe(attention, {"input_ids": x}, lambda b: attention(b["input_ids"], x, x))  # need_weights=True
    message = str(raised.value)
    assert "stopped on a refusal" in message and "need_weights=False" in message, message
    assert "verify='off'" not in message, message

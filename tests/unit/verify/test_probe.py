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


class HeldPartsLM(nn.Module):
    """A LightningModule's layout without a forward: the parts are attributes, training_step runs them."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.final_norm = nn.LayerNorm(32)
        self.lm_head = nn.Linear(32, 64, bias=False)

    def step_logits(self, ids):
        x = self.embedding(ids)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.final_norm(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.attention = Attention()
        self.mlp_norm = nn.LayerNorm(32)
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        x = x + self.attention(self.norm(x))
        return x + self.fc2(torch.relu(self.fc1(self.mlp_norm(x))))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_heads = 4
        self.q, self.k, self.v, self.o = (nn.Linear(32, 32, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, 4, 8).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, 32))


def test_a_lightning_module_without_forward_is_probed_through_its_pieces_in_order():
    import lightning as L

    from lightning_5d.plan import discover
    from lightning_5d.verify.probe import probe_call

    class NoForward(L.LightningModule):  # the model is the LightningModule; training_step would run it
        def __init__(self):
            super().__init__()
            held = HeldPartsLM()
            self.embedding, self.blocks = held.embedding, held.blocks
            self.final_norm, self.lm_head = held.final_norm, held.lm_head
            self.step_logits = held.step_logits

    torch.manual_seed(0)
    module = NoForward()
    call = probe_call(module, discover(module))
    assert call is not None
    seen = []
    for name in ("embedding", "blocks.0", "blocks.1", "final_norm", "lm_head"):
        module.get_submodule(name).register_forward_hook(lambda *_a, _n=name: seen.append(_n))
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        out = call(ids)
    assert seen == ["embedding", "blocks.0", "blocks.1", "final_norm", "lm_head"]  # every piece, once, in order
    torch.testing.assert_close(out, module.step_logits(ids), rtol=0, atol=0)
    assert "forward" not in vars(module)  # the stand-in forward is gone after the call


class FullWidthSplit(nn.Module):
    """A fused projection split by a width that does not fit its output (as under tp without the replay)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.qkv = nn.Embedding(16, 8), nn.Linear(8, 12)

    def forward(self, ids):
        q, k, v = self.qkv(self.embed(ids)).split(8, dim=2)
        return q + k + v


def test_a_failure_in_the_model_names_the_line_of_the_model_that_failed():
    module = FullWidthSplit()
    with pytest.raises(ProbeError) as raised:
        run_probe(module, {"input_ids": torch.zeros(1, 4, dtype=torch.long)}, lambda b: module(b["input_ids"]))
    message = str(raised.value)
    assert "not enough values to unpack" in message
    assert "(at test_probe.py:" in message and "`q, k, v = self.qkv(self.embed(ids)).split(8, dim=2)`" in message


def test_a_refusal_met_in_the_probe_forward_keeps_its_own_advice():
    from lightning_5d.parallel.tensor.packed_attention import run_local_heads

    attention = nn.MultiheadAttention(8, 2, batch_first=True)
    run_local_heads(attention, rank=0, tp=1)
    x = torch.zeros(1, 4, 8)
    with pytest.raises(ProbeError) as raised:
        run_probe(attention, {"input_ids": x}, lambda b: attention(b["input_ids"], x, x))  # need_weights=True
    message = str(raised.value)
    assert "stopped on a refusal" in message and "need_weights=False" in message, message
    assert "verify='off'" not in message, message

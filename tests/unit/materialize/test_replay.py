"""A meta-device build, recorded, gives back exactly the tensors of an eager build from the same seed."""

import pytest
import torch
from torch import nn

from lightning_5d.materialize import InitLog, MaterializeError, Replay, recording
from lightning_5d.materialize.apply import capture
from lightning_5d.models.llama import LlamaConfig, LlamaModel

TINY = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


class Handwritten(nn.Module):
    """Init styles a user writes: trunc_normal_, orthogonal_, .data writes, a table filled piece by piece."""

    def __init__(self):
        super().__init__()
        table = torch.empty(8, 6)
        pos = torch.arange(8).float()[:, None]
        table[:, 0::2] = torch.sin(pos * torch.arange(3.0))
        table[:, 1::2] = torch.cos(pos)
        self.register_buffer("table", table, persistent=False)
        self.emb = nn.Embedding(10, 6, padding_idx=2)
        self.proj = nn.Linear(6, 4)
        self.scale = nn.Parameter(torch.randn(3, 3) * 0.1)
        nn.init.trunc_normal_(self.proj.weight, std=0.02)
        nn.init.orthogonal_(self.emb.weight)
        self.proj.bias.data.zero_()


class Uninitialized(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.gain = nn.Parameter(torch.empty(4))  # never filled, and no reset_parameters


def _builds(build):
    torch.manual_seed(7)
    eager = build()
    after_eager = torch.rand(3)
    torch.manual_seed(7)
    log = InitLog()
    with recording(log):
        meta = build()
    return eager, meta, log, after_eager, torch.rand(3)


@pytest.mark.parametrize("build", [lambda: LlamaModel(TINY), Handwritten], ids=["reference_llama", "handwritten"])
def test_replayed_tensors_equal_an_eager_build(build):
    eager, meta, log, after_eager, after_meta = _builds(build)
    assert all(t.is_meta for t in meta.parameters())
    refs = capture(meta, log)
    expected = {**dict(eager.named_parameters(remove_duplicate=False)), **dict(eager.named_buffers())}
    assert refs.keys() == expected.keys()
    replay = Replay(log)
    for name in reversed(list(refs)):  # any order: each draw restores its own generator state
        assert torch.equal(replay.value(refs[name]), expected[name]), name
    assert torch.equal(after_eager, after_meta)  # the build leaves the generator where an eager build does


def test_hugging_face_model_gets_its_init_weights_values():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    eager, meta, log, _, _ = _builds(lambda: transformers.LlamaForCausalLM(config))
    refs = capture(meta, log)
    replay = Replay(log)
    expected = {**dict(eager.named_parameters(remove_duplicate=False)), **dict(eager.named_buffers())}
    for name, ref in refs.items():  # rotary inv_freq included
        assert torch.equal(replay.value(ref), expected[name]), name


def test_module_without_any_init_gets_an_error_naming_it():
    log = InitLog()
    with recording(log):
        model = nn.Sequential(Uninitialized())
    expected = r"(?s)0\.gain \(module '0', Uninitialized\).*torch\.empty.*reset_parameters"
    with pytest.raises(MaterializeError, match=expected):
        capture(model, log)


def test_meta_model_from_outside_uses_its_reset_parameters():
    with torch.device("meta"):  # not recorded: the modules' own reset_parameters() fill it
        model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    log = InitLog()
    torch.manual_seed(0)
    refs = capture(model, log)  # draws from the generator as it is now, module by module
    torch.manual_seed(0)
    eager = nn.Linear(4, 3)
    replay = Replay(log)
    assert torch.equal(replay.value(refs["0.weight"]), eager.weight)
    assert torch.equal(replay.value(refs["0.bias"]), eager.bias)
    assert torch.equal(replay.value(refs["1.weight"]), torch.ones(3))

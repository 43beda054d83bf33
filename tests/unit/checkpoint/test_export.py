"""``export_checkpoint`` / ``l5d export`` and ``hf_info`` in one process.

Sharded checkpoints are built here with torch.distributed.checkpoint in the documented
on-disk format (DCP files with "model.<name>" keys, layout.json, COMPLETE); the
multi-process save itself is covered in tests/distributed/checkpoint/test_export.py.
"""

import argparse
import json

import lightning as L
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from lightning_5d.checkpoint import CheckpointError
from lightning_5d.checkpoint.export import ExportFormat, export_checkpoint, hf_info, register, untie

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
from safetensors.torch import load_file  # noqa: E402


def build_hf(name: str) -> nn.Module:
    tf = transformers
    common = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64)  # fmt: skip
    if name == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common, intermediate_size=64, tie_word_embeddings=False))
    if name == "llama_tied":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common, intermediate_size=64, tie_word_embeddings=True))
    if name == "gpt2":  # Conv1D projections, learned positions, tied head
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=64))
    if name == "mixtral":  # grouped experts ([E, ...] weights)
        config = tf.MixtralConfig(**common, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                  tie_word_embeddings=False)  # fmt: skip
        return tf.MixtralForCausalLM(config)
    raise ValueError(name)


class CausalLM(L.LightningModule):
    """A LightningModule around a Hugging Face model, plus a parameter of its own."""

    def __init__(self, name: str = "llama"):
        super().__init__()
        torch.manual_seed(0)
        self.model = build_hf(name)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, ids):
        return self.model(input_ids=ids).logits * self.scale


class Plain(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.proj = nn.Linear(8, 8)


def write_full(module, path):
    torch.save({"state_dict": module.state_dict(), "epoch": 0, "global_step": 3}, path)
    return path


def write_sharded(module, path, hf="auto"):
    """A sharded checkpoint as trainer.save_checkpoint writes it (model entries only)."""
    path.mkdir()
    dcp.save({f"model.{k}": v.clone() for k, v in module.state_dict().items()}, checkpoint_id=path, no_dist=True)
    layout = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1, "ep": 1}
    info = hf_info(module) if hf == "auto" else hf
    meta = {"format": 1, "layout": layout, "zero": 1, "world_size": 1, "hf": info}
    (path / "layout.json").write_text(json.dumps(meta))
    torch.save({"epoch": 0, "global_step": 3}, path / "meta.pt")
    (path / "COMPLETE").write_text("")
    return path


def l5d_export(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="l5d")
    register(parser.add_subparsers())
    args = parser.parse_args(["export", *argv])
    return args.func(args)


def assert_same(state, expected):
    assert sorted(state) == sorted(expected)
    for k, v in expected.items():
        assert torch.equal(state[k], v), k


# ---------------------------------------------------------------------- hf_info
def test_hf_info_names_the_nested_model_and_its_config():
    module = CausalLM("llama")
    info = hf_info(module)
    assert info["prefix"] == "model." and info["class"] == "LlamaForCausalLM"
    config = json.loads(json.dumps(info["config"]))  # JSON-ready, as layout.json stores it
    rebuilt = transformers.AutoConfig.for_model(**config)
    assert isinstance(rebuilt, transformers.LlamaConfig) and rebuilt.hidden_size == 32
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert hf_info(module.model)["prefix"] == ""  # the model itself
    assert hf_info(Plain()) is None


def test_hf_info_sees_through_wrapping_subclasses():
    class Wrapped(transformers.LlamaForCausalLM):  # as FSDP2's fully_shard or a user subclass would make it
        pass

    module = CausalLM("llama")
    module.model.__class__ = Wrapped
    assert hf_info(module)["class"] == "LlamaForCausalLM"


# ---------------------------------------------------------------------- plain formats
@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_export_without_hf_info_keeps_every_name(tmp_path, fmt, kind):
    module = Plain()
    ckpt = tmp_path / "last.ckpt"
    write_full(module, ckpt) if kind == "full" else write_sharded(module, ckpt)
    out = tmp_path / f"weights.{fmt}"
    result = export_checkpoint(ckpt, out)
    assert result.format == ExportFormat(fmt) and result.prefix == "" and not result.left_out
    state = load_file(out) if fmt == "safetensors" else torch.load(out, weights_only=True)
    assert_same(state, module.state_dict())  # the tied head comes back as its own copy
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["last.ckpt", out.name])


def test_sharded_export_strips_the_hf_prefix_and_reports_the_rest(tmp_path):
    module = CausalLM("llama")
    ckpt = write_sharded(module, tmp_path / "last.ckpt")
    result = export_checkpoint(ckpt, tmp_path / "w.safetensors")
    assert result.prefix == "model." and result.left_out == ["scale"]
    assert_same(load_file(tmp_path / "w.safetensors"), module.model.state_dict())
    result = export_checkpoint(ckpt, tmp_path / "all.pt", prefix="")
    assert_same(torch.load(tmp_path / "all.pt", weights_only=True), module.state_dict())


def test_untie_copies_only_shared_tensors():
    w = torch.randn(4, 4)
    state = untie({"a": w, "b": w, "c": w[1], "d": torch.randn(3)})
    ptrs = {k: v.untyped_storage().data_ptr() for k, v in state.items()}
    assert len(set(ptrs.values())) == 4
    assert torch.equal(state["b"], w) and torch.equal(state["c"], w[1]) and state["c"].is_contiguous()


# ---------------------------------------------------------------------- Hugging Face folders
@pytest.mark.parametrize("name", ["llama", "llama_tied", "gpt2", "mixtral"])
@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_hf_export_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path, name, kind):
    module = CausalLM(name).eval()
    ckpt = tmp_path / "last.ckpt"
    if kind == "sharded":
        write_sharded(module, ckpt)
    else:  # a full file that records its layout (with "hf") under "layout"
        torch.save({"state_dict": module.state_dict(), "layout": {"hf": hf_info(module)}}, ckpt)
    assert l5d_export(str(ckpt), str(tmp_path / "hf")) == 0  # a folder name: hf
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = module.model(input_ids=ids).logits
        for cls in (transformers.AutoModelForCausalLM, type(module.model)):
            loaded = cls.from_pretrained(tmp_path / "hf").eval()
            assert type(loaded) is type(module.model)
            got = loaded(input_ids=ids).logits
            assert (got - expected).abs().max().item() == 0.0
    assert_same(loaded.state_dict(), module.model.state_dict())


# ---------------------------------------------------------------------- bad input
def test_bad_input_exits_2_and_writes_nothing(tmp_path, capsys):
    ckpt = write_sharded(Plain(), tmp_path / "plain.ckpt")
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint")
    folder = tmp_path / "folder"
    folder.mkdir()
    existing = tmp_path / "existing.pt"
    existing.write_bytes(b"keep me")
    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(2)}, plain)
    before = sorted(p.name for p in tmp_path.iterdir())
    cases = [
        ((str(tmp_path / "missing.ckpt"), str(tmp_path / "o.pt")), "does not exist"),
        ((str(folder), str(tmp_path / "o.pt")), "nor a folder of complete checkpoints"),
        ((str(garbage), str(tmp_path / "o.pt")), str(garbage)),
        ((str(ckpt), str(tmp_path / "o"), "--format", "hf"), "no Hugging Face model information"),
        ((str(ckpt), str(tmp_path / "o")), "cannot tell the format"),
        ((str(ckpt), str(tmp_path / "o.pt"), "--prefix", "nothing."), "no tensors under the prefix"),
        ((str(plain), str(tmp_path / "o.pt")), "not a Lightning checkpoint"),
        ((str(ckpt), str(existing)), f"{existing} exists; pass --overwrite to replace it."),
        ((str(ckpt), str(tmp_path / "no" / "o.pt")), "does not exist"),
    ]
    for argv, message in cases:
        assert l5d_export(*argv) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert garbage.read_bytes() == b"not a checkpoint" and existing.read_bytes() == b"keep me"


def test_overwrite_replaces_an_existing_folder(tmp_path):
    module = CausalLM("llama")
    ckpt = write_sharded(module, tmp_path / "last.ckpt")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    assert l5d_export(str(ckpt), str(out), "--format", "hf", "--overwrite") == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "last.ckpt"]


def test_hf_format_refuses_another_prefix(tmp_path):
    ckpt = write_sharded(CausalLM("llama"), tmp_path / "last.ckpt")
    with pytest.raises(ValueError, match="leave out the prefix"):
        export_checkpoint(ckpt, tmp_path / "hf", "hf", prefix="")


def test_l5d_export_is_a_subcommand(tmp_path, capsys):
    from lightning_5d.cli import main

    ckpt = write_full(Plain(), tmp_path / "last.ckpt")
    assert main(["export", str(ckpt), str(tmp_path / "w.safetensors")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["export", str(tmp_path / "nope"), str(tmp_path / "x.pt")]) == 2


def test_missing_checkpoint_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        export_checkpoint(tmp_path / "nope.ckpt", tmp_path / "x.pt")


def test_a_folder_of_checkpoints_exports_the_one_latest_names(tmp_path, capsys):
    from lightning_5d.checkpoint import files

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    first = write_sharded(Plain(), folder / "epoch=0-step=10.ckpt")
    files.update_latest(first)
    assert l5d_export(str(folder), str(tmp_path / "w.pt")) == 0
    assert f"read {first}" in capsys.readouterr().out
    with pytest.raises(FileExistsError, match="replace it with overwrite=True"):
        export_checkpoint(folder, tmp_path / "w.pt")

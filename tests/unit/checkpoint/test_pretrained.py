"""``load_pretrained`` in one process, with a stand-in strategy (the multi-process layouts are
in tests/distributed/checkpoint/test_export.py)."""

import json
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from lightning_5d.checkpoint import CheckpointError
from lightning_5d.checkpoint import pretrained
from lightning_5d.checkpoint.export import save_safetensors
from lightning_5d.checkpoint.pretrained import load_pretrained, open_state

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def build_llama(seed: int, hidden: int = 32, tied: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=tied)  # fmt: skip
    return transformers.LlamaForCausalLM(config)


class CausalLM(L.LightningModule):
    def __init__(self, model: nn.Module, extra: bool = False):
        super().__init__()
        self.model = model
        if extra:
            self.scale = nn.Parameter(torch.ones(1))


class Strategy:
    """What load_pretrained needs of a strategy: the module and its tp / ep / pp splits."""

    def __init__(self, module, splits=()):
        self.lightning_module = module
        self.checkpoints = SimpleNamespace(splits=list(splits))


def write(source: nn.Module, tmp_path, kind: str):
    state = {k: v.clone() for k, v in source.state_dict().items()}
    if kind == "safetensors":
        save_file(state, tmp_path / "w.safetensors")
        return tmp_path / "w.safetensors"
    if kind == "pt":
        torch.save(state, tmp_path / "w.pt")
        return tmp_path / "w.pt"
    if kind == "ckpt":  # a full Lightning checkpoint: the LightningModule's names
        torch.save({"state_dict": CausalLM(source).state_dict(), "epoch": 1}, tmp_path / "w.ckpt")
        return tmp_path / "w.ckpt"
    folder = tmp_path / "hf"
    if kind == "hf":
        source.save_pretrained(folder)
    elif kind == "hf_sharded":
        source.save_pretrained(folder, max_shard_size="40KB")
        assert (folder / "model.safetensors.index.json").is_file()
    elif kind == "hf_bin":
        folder.mkdir()
        source.config.save_pretrained(folder)
        torch.save(state, folder / "pytorch_model.bin")
    return folder


def assert_loaded(module: nn.Module, source: nn.Module, prefix="model."):
    mine = module.state_dict()
    for k, v in source.state_dict().items():
        assert torch.equal(mine[prefix + k], v), k


@pytest.mark.parametrize("kind", ["safetensors", "pt", "ckpt", "hf", "hf_sharded", "hf_bin"])
def test_every_source_loads_every_entry(tmp_path, kind):
    source = build_llama(0)
    path = write(source, tmp_path, kind)
    target = CausalLM(build_llama(1))
    strategy = Strategy(target)
    report = load_pretrained(strategy, path)
    assert report.prefix == ("" if kind == "ckpt" else "model.")  # found by itself
    assert report.loaded == len(target.state_dict()) and not report.missing and not report.unexpected
    assert_loaded(target, source)


def test_tied_weights_saved_once_load_both_names(tmp_path):
    source = build_llama(0, tied=True)
    path = write(source, tmp_path, "hf")  # save_pretrained leaves lm_head.weight out
    assert "lm_head.weight" not in open_state(path).keys()
    target = CausalLM(build_llama(1, tied=True))
    load_pretrained(Strategy(target), path)
    assert_loaded(target, source)
    assert target.model.lm_head.weight is target.model.model.embed_tokens.weight


def test_files_of_the_base_model_find_their_prefix(tmp_path):
    """Hub GPT-2 files come from GPT2Model: "h.0...", not GPT2LMHeadModel's "transformer.h.0..."."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    base = transformers.GPT2Model(config)
    state = {k: v.clone() for k, v in base.state_dict().items()}
    state["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64))  # old causal masks, ignored as GPT-2 does
    base.config.save_pretrained(tmp_path / "base")
    save_file(state, tmp_path / "base" / "model.safetensors")
    torch.manual_seed(1)
    target = CausalLM(transformers.GPT2LMHeadModel(config))
    report = load_pretrained(Strategy(target), tmp_path / "base")
    assert report.prefix == "model.transformer." and not report.missing  # the tied head is the embedding
    assert_loaded(target, base, prefix="model.transformer.")


def test_moe_folders_stored_per_expert_get_a_conversion_hint(tmp_path):
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=256, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, tie_word_embeddings=False)  # fmt: skip
    source = transformers.MixtralForCausalLM(config)
    source.save_pretrained(tmp_path / "hub")  # the Hub's layout: experts.<i>.w1 / w2 / w3
    target = CausalLM(transformers.MixtralForCausalLM(config))
    with pytest.raises(CheckpointError, match="(?s)experts.0.w1.weight.*names transformers converts while loading"):
        load_pretrained(Strategy(target), tmp_path / "hub")
    # The documented one-time conversion: in-memory names, then a key-by-key load.
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hub")
    save_safetensors(loaded.state_dict(), tmp_path / "fused.safetensors")
    load_pretrained(Strategy(target), tmp_path / "fused.safetensors")
    assert_loaded(target, source)


class HalfRows:
    """A stand-in tensor-parallel split: this rank keeps the first half of some weights' rows."""

    def __init__(self, names):
        self.names = set(names)

    def local_state(self, state):
        return {k: v[: v.shape[0] // 2].clone() if k in self.names else v for k, v in state.items()}

    def local_region(self, name, region):
        return region.select(0, [(0, region.local_shape[0] // 2)]) if name in self.names else region


def test_split_layouts_check_and_load_their_own_pieces(tmp_path):
    source = build_llama(0)
    path = write(source, tmp_path, "safetensors")
    target = CausalLM(build_llama(1))
    names = [f"model.model.layers.{i}.self_attn.q_proj.weight" for i in range(2)]
    for i in range(2):
        attn = target.model.model.layers[i].self_attn
        attn.q_proj.weight = nn.Parameter(attn.q_proj.weight[:16].clone())
    load_pretrained(Strategy(target, [HalfRows(names)]), path)
    for i, name in enumerate(names):
        full = source.model.layers[i].self_attn.q_proj.weight
        assert torch.equal(target.state_dict()[name], full[:16])
    wrong = build_llama(0)
    for i in range(2):  # a file whose q_proj halves do not fit this rank's piece
        wrong.model.layers[i].self_attn.q_proj.weight = nn.Parameter(torch.zeros(16, 32))
    with pytest.raises(CheckpointError, match=r"(?s)wrong shapes.*q_proj.weight: file \[16, 32\] -> \[8, 32\]"):
        load_pretrained(Strategy(target, [HalfRows(names)]), write(wrong, tmp_path / "w", "hf"))


def test_a_rank_reads_only_the_entries_it_holds(tmp_path, monkeypatch):
    """As a pipeline stage: the other stage's entries are held elsewhere, so they are not unexpected."""
    source = build_llama(0)
    path = write(source, tmp_path, "safetensors")
    target = CausalLM(build_llama(1))
    full_keys = list(target.state_dict())
    del target.model.model.layers[1]
    others = [k for k in full_keys if k not in target.state_dict()]
    assert others
    real_gather = pretrained._gather
    monkeypatch.setattr(pretrained, "_gather", lambda obj: [obj, others] if isinstance(obj, list) else real_gather(obj))
    read = []
    real_read, real_read_into = pretrained.StateSource.read, pretrained.StateSource.read_into
    monkeypatch.setattr(pretrained.StateSource, "read", lambda self, key, i: read.append(key) or real_read(self, key, i))
    monkeypatch.setattr(pretrained.StateSource, "read_into",
                        lambda self, key, i, out: real_read_into(self, key, i, out) and not read.append(key))  # fmt: skip
    report = load_pretrained(Strategy(target), path)
    assert sorted("model." + k for k in read) == sorted(target.state_dict()) and report.loaded == len(read)
    for k, v in target.state_dict().items():
        assert torch.equal(v, source.state_dict()[k[len("model.") :]]), k


# ---------------------------------------------------------------------- mismatches
def unchanged(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


def assert_unchanged(module, before):
    for k, v in module.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_missing_entries_raise_before_loading_or_are_reported(tmp_path):
    source = build_llama(0)
    path = write(source, tmp_path, "hf")
    target = CausalLM(build_llama(1), extra=True)  # a parameter of its own the file cannot have
    before = unchanged(target)
    with pytest.raises(CheckpointError, match=r"(?s)do not match the model.*missing in the file: scale"):
        load_pretrained(Strategy(target), path)
    assert_unchanged(target, before)
    report = load_pretrained(Strategy(target), path, strict=False)
    assert report.missing == ["scale"] and not report.unexpected
    assert_loaded(target, source)


def test_unexpected_and_wrongly_shaped_entries_are_listed(tmp_path):
    target = CausalLM(build_llama(1))
    before = unchanged(target)
    bigger = {**build_llama(0).state_dict(), "extra.weight": torch.ones(2)}
    save_file({k: v.clone() for k, v in bigger.items()}, tmp_path / "extra.safetensors")
    with pytest.raises(CheckpointError, match="not in the model: model.extra.weight"):
        load_pretrained(Strategy(target), tmp_path / "extra.safetensors")
    other = write(build_llama(0, hidden=48), tmp_path, "hf")
    with pytest.raises(CheckpointError, match=r"(?s)wrong shapes.*embed_tokens.weight: file \[256, 48\]"):
        load_pretrained(Strategy(target), other, strict=False)  # shapes are never skipped
    assert_unchanged(target, before)
    with pytest.raises(CheckpointError, match="not in the model"):
        load_pretrained(Strategy(target), write(build_llama(0), tmp_path / "p", "hf"), prefix="")


def test_bad_sources_get_clear_errors(tmp_path):
    target = CausalLM(build_llama(1))
    with pytest.raises(CheckpointError, match="do not exist"):
        load_pretrained(Strategy(target), tmp_path / "nope.safetensors")
    torch.save([torch.ones(1)], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match="holds a list, not a state dict"):
        load_pretrained(Strategy(target), tmp_path / "list.pt")
    (tmp_path / "garbage.bin").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="could not be read as a state dict"):
        load_pretrained(Strategy(target), tmp_path / "garbage.bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="folder without model.safetensors"):
        load_pretrained(Strategy(target), tmp_path / "empty")
    sharded = tmp_path / "last.ckpt"
    dcp.save({"model.w": torch.ones(2)}, checkpoint_id=sharded, no_dist=True)
    with pytest.raises(CheckpointError, match="l5d export"):
        load_pretrained(Strategy(target), sharded)
    index = write(build_llama(0), tmp_path / "s", "hf_sharded") / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())
    weight_map["weight_map"]["lm_head.weight"] = "model-missing.safetensors"
    index.write_text(json.dumps(weight_map))
    with pytest.raises(CheckpointError, match="names model-missing.safetensors"):
        load_pretrained(Strategy(target), index.parent)


# ---------------------------------------------------------------------- slices only
class FusedBlock(nn.Module):
    """A fused [q|k|v] (grouped kv) and [gate|up], a row-parallel output, and an embedding."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.qkv = nn.Linear(16, 32, bias=True)  # q 16, k 8, v 8
        self.o = nn.Linear(16, 16, bias=False)
        self.gate_up = nn.Linear(16, 48, bias=False)
        self.norm = nn.LayerNorm(16)


def test_a_tensor_parallel_rank_reads_its_slices_and_nothing_more(tmp_path, monkeypatch):
    """A counting reader: the bytes a rank reads are exactly its share, each read at most one
    tensor's slice, and no cut tensor is ever read whole."""
    from lightning_5d.parallel.tensor.sharding import TensorParallel, TensorShard

    torch.manual_seed(0)
    source = FusedBlock()
    path = tmp_path / "w.safetensors"
    save_file({k: v.detach().clone() for k, v in source.state_dict().items()}, path)
    shards = {"embed.weight": TensorShard(0), "qkv.weight": TensorShard(0, (16, 8, 8)),
              "qkv.bias": TensorShard(0, (16, 8, 8)), "o.weight": TensorShard(1),
              "gate_up.weight": TensorShard(0, (24, 24))}  # fmt: skip
    size = 2
    real_read, real_read_into = pretrained.StateSource.read, pretrained.StateSource.read_into
    for rank in range(size):
        tp = object.__new__(TensorParallel)
        tp.shards, tp.rank, tp.size = shards, rank, size
        target = FusedBlock()
        for name, shard in shards.items():  # this rank's pieces, as tensor parallelism leaves them
            module, attr = name.rsplit(".", 1)
            piece = shard.take(getattr(target.get_submodule(module), attr).detach(), rank, size)
            setattr(target.get_submodule(module), attr, nn.Parameter(torch.zeros_like(piece)))
        reads = []

        def counting(self, key, index):
            value = real_read(self, key, index)
            reads.append((key, value.numel() * value.element_size()))
            return value

        def counting_into(self, key, index, out):  # a rectangle read in place: no tensor of its own
            done = real_read_into(self, key, index, out)
            if done:
                reads.append((key, out.numel() * out.element_size()))
            return done

        monkeypatch.setattr(pretrained.StateSource, "read", counting)
        monkeypatch.setattr(pretrained.StateSource, "read_into", counting_into)
        report = load_pretrained(Strategy(target, [tp]), path)
        share = {k: v.numel() * v.element_size() for k, v in target.state_dict().items()}
        assert report.bytes_read == sum(n for _, n in reads) == sum(share.values())  # exactly the share
        full = source.state_dict()
        for key, n in reads:
            assert n <= share[key]  # one rectangle of one tensor's slice at a time
            if key in shards:
                assert n < full[key].numel() * full[key].element_size(), f"{key} read whole"
        for name, value in target.state_dict().items():
            want = shards[name].take(full[name], rank, size) if name in shards else full[name]
            assert torch.equal(value, want), (rank, name)


# ---------------------------------------------------------------------- reading in place
def test_a_run_of_the_files_bytes_is_read_straight_into_the_target(tmp_path):
    torch.manual_seed(0)
    full = {"w": torch.randn(8, 6), "h": torch.randn(8, 6).bfloat16(), "b": torch.randn(2, 4, 3)}
    path = tmp_path / "w.safetensors"
    save_file(full, path)
    source = open_state(path)
    rows = torch.empty(3, 6)  # a ZeRO-3 row shard
    assert source.read_into("w", (slice(2, 5), slice(0, 6)), rows) and torch.equal(rows, full["w"][2:5])
    inner = torch.empty(1, 2, 3)  # one index of dim 0, a run of dim 1, dim 2 whole
    assert source.read_into("b", (slice(1, 2), slice(1, 3), slice(0, 3)), inner)
    assert torch.equal(inner, full["b"][1:2, 1:3])
    bf16 = torch.empty(2, 6, dtype=torch.bfloat16)
    assert source.read_into("h", (slice(6, 8), slice(0, 6)), bf16) and torch.equal(bf16, full["h"][6:8])
    # Not one run, another dtype than the file's, a target that is not contiguous: left to read().
    untouched = torch.zeros(8, 3)
    assert not source.read_into("w", (slice(0, 8), slice(0, 3)), untouched) and not untouched.any()
    assert not source.read_into("h", (slice(0, 2), slice(0, 6)), torch.zeros(2, 6))
    assert not source.read_into("w", (slice(0, 3), slice(0, 6)), torch.zeros(6, 3).t())
    # Not on the CPU (a GPU parameter; meta stands in for it): read through get_slice, then copied.
    assert not source.read_into("w", (slice(2, 5), slice(0, 6)), torch.empty(3, 6, device="meta"))


def test_a_truncated_entry_read_in_place_is_refused_with_the_fix(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.randn(64, 16)}, path)
    source = open_state(path)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)
    with pytest.raises(CheckpointError, match="truncated.*copy it again"):
        source.read_into("w", (slice(60, 64), slice(0, 16)), torch.empty(4, 16))

"""Export of sharded checkpoints and import of pretrained weights, across processes.

Runs are ``scripts/ckpt_export_import.py`` under torch.distributed.run (gloo, fp32): it trains,
saves ``last.ckpt`` with ``trainer.save_checkpoint`` (the sharded format) and writes the full
final state its ranks hold; with ``--pretrained`` it first loads a plain / Hugging Face state
dict into the parallelized model with ``load_pretrained``. Exports are made here, in this
single process, from the checkpoint the ranks wrote.
"""

import json

import pytest
import torch

from lightning_5d.checkpoint.export import export_checkpoint, save_safetensors
from hf_support import build_hf_model, hf_reference_run
from reference import reference_run
from tests_support import SCRIPTS, parameter_vector_error, run_distributed

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def run(out, nproc, model, *extra, timeout=200):
    out.mkdir(exist_ok=True)
    args = ["--model", model, "--out", str(out), *map(str, extra)]
    run_distributed(SCRIPTS / "ckpt_export_import.py", nproc, args, timeout=timeout).check()
    return json.loads((out / "result.json").read_text())["losses"], torch.load(out / "params.pt")


def data_ranks(nproc: int, layout: list) -> int:
    """Ranks reading different batches: tp and pp peers read the same ones (ep borrows data ranks)."""
    size = {flag: int(layout[layout.index(flag) + 1]) if flag in layout else 1 for flag in ("--tp", "--pp")}
    return nproc // (size["--tp"] * size["--pp"])


def assert_equal_states(got, expected, prefix=""):
    assert sorted(got) == sorted(k[len(prefix) :] for k in expected if k.startswith(prefix))
    for k, v in got.items():
        assert torch.equal(v, expected[prefix + k]), k


# ---------------------------------------------------------------------- export
@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "nproc,layout",
    [
        (2, ["--zero", 3]),  # FSDP2 shards: each rank wrote half of every tensor
        pytest.param(4, ["--tp", 2, "--sp", "--zero", 1], marks=pytest.mark.slow),  # tp pieces + ZeRO-1
        pytest.param(2, ["--pp", 2, "--weights-only"], marks=pytest.mark.slow),  # each stage wrote its blocks
    ],
)
def test_export_of_a_sharded_checkpoint_equals_the_single_process_state(tmp_path, nproc, layout):
    steps = 3
    _, params = run(tmp_path / "run", nproc, "tiny", "--steps", steps, *layout)
    ckpt = tmp_path / "run" / "last.ckpt"
    assert ckpt.is_dir() and (ckpt / ".metadata").is_file()  # the sharded format
    export_checkpoint(ckpt, tmp_path / "w.safetensors")
    export_checkpoint(ckpt, tmp_path / "w.pt")
    exported = load_file(tmp_path / "w.safetensors")
    assert_equal_states(exported, params)  # bit for bit what the ranks held
    assert_equal_states(torch.load(tmp_path / "w.pt", weights_only=True), params)
    _, ref_params = reference_run(steps, data_ranks(nproc, layout))
    error = parameter_vector_error(exported, ref_params)  # one process, same batches: the usual 1e-5
    print(f"export vs single process: parameter vector relative error {error:.2e}")
    assert error <= 1e-5


def logits_of(model, ids):
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "model,nproc,layout",
    [
        ("llama", 2, ["--tp", 2]),
        pytest.param("gpt2", 2, ["--zero", 3], marks=pytest.mark.slow),  # tied head
        pytest.param("gpt2", 2, ["--pp", 2], marks=pytest.mark.extended),  # the tied head's two pipeline copies
        pytest.param("mixtral", 2, ["--ep", 2, "--weights-only"], marks=pytest.mark.slow),  # experts split over ep
    ],
)
def test_hf_export_reloads_with_from_pretrained_and_gives_the_same_logits(tmp_path, model, nproc, layout):
    steps = 2
    _, params = run(tmp_path / "run", nproc, model, "--steps", steps, *layout)
    export_checkpoint(tmp_path / "run" / "last.ckpt", tmp_path / "hf", "hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    trained = build_hf_model(model)
    trained.load_state_dict({k[len("model.") :]: v for k, v in params.items()})
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    got, expected = logits_of(loaded, ids), logits_of(trained, ids)
    diff = (got - expected).abs().max().item()
    _, ref_state = hf_reference_run(model, steps, data_ranks(nproc, layout))
    reference = build_hf_model(model)
    reference.load_state_dict({k[len("model.") :]: v for k, v in ref_state.items()})
    ref_diff = (got - logits_of(reference, ids)).abs().max().item()
    print(f"{model}: logits max |diff| vs the trained state {diff:.2e}, vs one process {ref_diff:.2e}")
    assert diff == 0.0
    assert ref_diff <= 1e-4 * logits_of(reference, ids).abs().max().item()


# ---------------------------------------------------------------------- import
def pretrained_source(tmp_path, model: str, shard: str | None = None, seed: int = 123):
    """A Hugging Face folder written by save_pretrained (tied weights stored once, as on the Hub).

    MoE models: save_pretrained stores experts one by one (the Hub's names), which transformers
    fuses while loading; load_pretrained takes the in-memory names, as `l5d export` writes them.
    """
    torch.manual_seed(seed)
    source = build_hf_model(model)
    folder = tmp_path / "pretrained"
    if model in ("mixtral", "qwen2_moe"):
        folder.mkdir()
        source.config.save_pretrained(folder)
        save_safetensors(source.state_dict(), folder / "model.safetensors")
    else:
        source.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return source, folder


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "model,nproc,layout,shard",
    [
        ("gpt2", 2, ["--zero", 3, "--load-at", "setup"], None),  # FSDP2 shards, tied head
        pytest.param("llama", 2, ["--tp", 2], None, marks=pytest.mark.slow),  # FiveDStrategy(pretrained=...)
        pytest.param("llama", 4, ["--tp", 2, "--zero", 3], "100KB", marks=pytest.mark.slow),  # sharded index
        pytest.param("llama", 4, ["--tp", 2, "--pp", 2, "--weights-only"], None, marks=pytest.mark.slow),
        pytest.param("mixtral", 2, ["--ep", 2, "--weights-only"], None, marks=pytest.mark.slow),
        # before the optimizers exist: ZeRO-1 masters and FSDP2 shards are made from the loaded weights
        pytest.param("llama", 2, ["--zero", 1, "--load-at", "parallelize"], None, marks=pytest.mark.slow),
        pytest.param("llama", 2, ["--zero", 3, "--load-at", "parallelize"], None, marks=pytest.mark.slow),
    ],
)
def test_pretrained_weights_load_into_a_parallelized_model(tmp_path, model, nproc, layout, shard):
    source, folder = pretrained_source(tmp_path, model, shard)
    steps = 2
    losses, _ = run(tmp_path / "run", nproc, model, "--steps", steps, "--pretrained", folder, *layout)
    loaded = torch.load(tmp_path / "run" / "loaded.pt")
    assert json.loads((tmp_path / "run" / "load.json").read_text())["prefix"] == "model."
    for k, v in source.state_dict().items():  # every entry, on whichever rank holds it, is the file's
        assert torch.equal(loaded["model." + k], v), k
    ref, _ = hf_reference_run(model, steps, data_ranks(nproc, layout), initial_state=source.state_dict())
    print(f"{model}: losses {losses} vs one process {ref}")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=0)


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_pretrained_weights_of_another_model_fail_on_every_rank(tmp_path):
    torch.manual_seed(0)
    other = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=4))
    other.save_pretrained(tmp_path / "other")
    result = run_distributed(
        SCRIPTS / "ckpt_export_import.py",
        2,
        ["--model", "gpt2", "--zero", "3", "--pretrained", str(tmp_path / "other"), "--out", str(tmp_path)],
        timeout=150,
    )
    assert not result.timed_out and result.returncode != 0
    assert "wrong shapes" in result.output and "transformer.wte.weight: file [256, 32]" in result.output
    assert not (tmp_path / "loaded.pt").exists()

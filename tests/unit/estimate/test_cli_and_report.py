"""`l5d estimate` / `l5d plan` through argparse, the JSON contract, and the charts."""

import json

import pytest

from lightning_5d.estimate import estimate, plan
from lightning_5d.estimate.plot import plot_memory

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

ESTIMATE_KEYS = {
    "model",
    "setup",
    "params",
    "params_active",
    "params_per_rank",
    "flops_per_step",
    "hardware_flops_per_step",
    "flops_per_token",
    "hardware_flops_per_token",
    "tokens_per_step",
    "memory_gib",
    "memory_rank",
    "comm_bytes_per_step",
    "comm",
    "bubble_fraction",
    "bubble_relative",
    "conventions",
}
PLAN_EXTRA_KEYS = {
    "rank",
    "ahead_because",
    "layout",
    "step_time_s",
    "time_breakdown_s",
    "tokens_per_second",
    "predicted_mfu",
    "fits",
    "why",
}
MEMORY_KEYS = {"params", "grads", "optimizer", "activations", "buffers", "total"}
COMM_KEYS = {"dp", "tp", "cp", "pp", "ep", "total"}


def test_estimate_command_from_the_brief(l5d):
    argv = "estimate --model llama3-70b --tp 8 --pp 4 --dp 4 --zero 1 --seq 4096 --mbs 1 --json".split()
    code, out, _ = l5d(argv)
    assert code == 0
    data = json.loads(out)
    assert set(data) == ESTIMATE_KEYS
    assert set(data["memory_gib"]) == MEMORY_KEYS
    assert set(data["comm_bytes_per_step"]) == COMM_KEYS
    assert data["params"] == 70_553_706_496
    assert data["setup"]["world_size"] == 128 and data["setup"]["dp_shard"] == 4 and data["setup"]["zero"] == 1
    assert data["memory_gib"]["total"] == pytest.approx(sum(data["memory_gib"][k] for k in MEMORY_KEYS - {"total"}))
    assert 0 < data["bubble_fraction"] < 1 and data["bubble_relative"] == pytest.approx(3 / 8)


def test_estimate_table_is_readable(l5d):
    code, out, _ = l5d("estimate --model l5d-tiny-moe --dp 2 --ep 2 --seq 256".split())
    assert code == 0
    for word in ("params", "activations", "all_to_all", "bubble", "total"):
        assert word in out


def test_estimate_reads_a_config_json(tmp_path, l5d):
    cfg = {
        "vocab_size": 256,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    code, out, _ = l5d(["estimate", "--model", str(path), "--seq", "128", "--json"])
    assert code == 0 and json.loads(out)["params"] == estimate("l5d-tiny").params.total


@pytest.mark.parametrize(
    "argv, message",
    [
        ("estimate --model l5d-tiny --tp 16", "valid tp: [1, 2, 4]"),
        ("estimate --model l5d-tiny --dp 12 --tp 8 --gpus 64", "dp*tp*pp*cp = 96 != gpus 64"),
        ("estimate --model no-such-model", "presets:"),
        ("plan --model llama3-70b --gpus 8 --dims dp", "fits in 80.0 GiB"),
    ],
)
def test_errors_exit_2_with_the_message(argv, message, l5d):
    code, out, err = l5d(argv.split())
    assert code == 2 and message in err and out == ""


def test_plan_command_from_the_brief(l5d):
    code, out, _ = l5d("plan --model llama3-8b --gpus 64 --gpu-mem 80 --gpus-per-node 8 --top 3".split())
    assert code == 0
    assert "why:" in out and out.count("\n") >= 6


def test_plan_json_keys(l5d):
    code, out, _ = l5d("plan --model l5d-tiny --gpus 4 --global-batch 16 --top 2 --json".split())
    assert code == 0
    rows = json.loads(out)["plan"]
    assert len(rows) == 2 and [r["rank"] for r in rows] == [1, 2]
    for row in rows:
        assert set(row) == ESTIMATE_KEYS | PLAN_EXTRA_KEYS
        assert set(row["memory_gib"]) == MEMORY_KEYS and set(row["comm_bytes_per_step"]) == COMM_KEYS
        assert row["fits"] is True


def test_estimate_plot(tmp_path, l5d):
    pytest.importorskip("matplotlib")
    png = tmp_path / "mem.png"
    code, _, _ = l5d(["estimate", "--model", "l5d-tiny", "--dp", "2", "--plot", str(png)])
    assert code == 0 and png.read_bytes()[:8] == PNG_MAGIC


def test_plan_plot(tmp_path, l5d):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    code, _, _ = l5d(["plan", "--model", "l5d-tiny", "--gpus", "4", "--top", "4", "--plot", str(png)])
    assert code == 0 and png.read_bytes()[:8] == PNG_MAGIC


def test_plot_names_the_extra_when_matplotlib_is_missing(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ImportError, match=r"pip install 'lightning-5d\[plot\]'"):
        plot_memory(estimate("l5d-tiny"), tmp_path / "x.png")


def test_plan_entry_layout_is_strategy_kwargs():
    (entry,) = plan("l5d-tiny", top=1, seq_len=256, global_batch=16)
    assert set(entry.layout()) == {"dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "zero"}

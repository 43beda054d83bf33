"""Models written the ways discovery used to get wrong (issue 22), trained against one process.

Each case trains a hand-written LM of ``discover_models`` (or Hugging Face GPT-NeoX) under one
layout and compares its per-step losses with a single-process run of the same module at 1e-5
relative. The fast tier batches its cases into one 2-process launch; the rest are ``extended``.
"""

import json
from pathlib import Path

import pytest

from discover_models import hand_reference_run
from tests_support import SCRIPTS, relative, run_distributed

ADVICE = {"layers.*.attn": "attention(heads=4)"}  # what the tp refusal of the PLAIN model suggests
GATE_UP_PLAN = {"layers.*.mlp.gate_up_proj": "mlp.column", "layers.*.mlp.down_proj": "mlp.row"}
PP = {"pp": 2, "pipeline": {"microbatches": 2}}

# name -> (processes, style, FiveDStrategy keywords, fast tier?)
CASES = {
    # silently wrong before: the embedding's sqrt(hidden) scale was dropped (6.2e-3 off)
    "scaled_embedding-tp2-sp": (2, "scaled_embedding", {"tp": 2, "sequence_parallel": True}, True),
    "scaled_embedding-tp2": (2, "scaled_embedding", {"tp": 2}, False),
    "scaled_embedding-tp2-zero3": (4, "scaled_embedding", {"tp": 2, "zero": 3}, False),
    # [gate|up] cut into contiguous halves (1.9e-3 off), also with the user's model_plan
    "fused_gate_up-tp2-plan": (2, "fused_gate_up", {"tp": 2, "model_plan": GATE_UP_PLAN}, True),
    "fused_gate_up-tp2": (2, "fused_gate_up", {"tp": 2}, False),
    # GPT-NeoX's per-head interleaved query_key_value cut as [q|k|v] (1.0e-2 off)
    "interleaved_qkv-tp2": (2, "interleaved_qkv", {"tp": 2}, True),
    "hf_neox-tp2-sp": (2, "hf_neox", {"tp": 2, "sequence_parallel": True}, False),
    # Phi-3 reads config.num_attention_heads at forward time (crashed under tp before)
    "hf_phi3-tp2-sp": (2, "hf_phi3", {"tp": 2, "sequence_parallel": True}, False),
    # refused before for information the dimension does not use
    "plain-tp2-advice": (2, "plain", {"tp": 2, "model_plan": ADVICE}, False),
    "plain-zero3": (2, "plain", {"zero": 3}, True),
    "plain-cp2": (2, "plain", {"cp": 2}, False),
    "plain-pp2": (2, "plain", PP, False),
    "module_dict-pp2": (2, "module_dict", PP, False),
    "module_dict-tp2": (2, "module_dict", {"tp": 2}, False),
    "module_dict-zero3": (2, "module_dict", {"zero": 3}, False),
    "nested-zero3": (2, "nested", {"zero": 3}, False),
    "nested-tp2": (2, "nested", {"tp": 2}, False),
}
REFUSED = {  # name -> (processes, style, keywords, what the message must say)
    "plain-tp2": (2, "plain", {"tp": 2}, "attention(heads=<N>)"),
    "nested-pp2": (2, "nested", PP, "no forward of their own"),
}


def _params(table):
    for name, (*_, fast) in table.items():
        yield pytest.param(name, marks=[] if fast else [pytest.mark.extended], id=name)


class _Launches:
    """Every selected case of one process count trained in one launch, on first use."""

    def __init__(self, out: Path, cases: dict) -> None:
        self.out, self.cases, self.done = out, cases, set()

    def result(self, name: str) -> dict:
        nproc = self.cases[name][0]
        if nproc not in self.done:
            self.done.add(nproc)
            batch = [{"style": style, "layout": layout, "out": str(self.out / key)}
                     for key, (n, style, layout, *_) in self.cases.items() if n == nproc]  # fmt: skip
            listing = self.out / f"cases_{nproc}.json"
            listing.write_text(json.dumps(batch))
            run = run_distributed(SCRIPTS / "discover_cases.py", nproc, ["--cases", str(listing)],
                                  timeout=60 + 60 * len(batch))  # fmt: skip
            run.check()
        return json.loads((self.out / name / "result.json").read_text())


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory):
    wanted = {}
    for item in request.session.items:
        if getattr(item, "module", None) is request.module and hasattr(item, "callspec"):
            name = item.callspec.params["name"]
            wanted[name] = {**CASES, **REFUSED}[name]
    return _Launches(tmp_path_factory.mktemp("discover"), wanted)


@pytest.mark.parametrize("name", list(_params(CASES)))
def test_trains_like_one_process(launches, name):
    _, style, _, _ = CASES[name]
    result = launches.result(name)
    assert "losses" in result, result
    reference = hand_reference_run(style, len(result["losses"]), result["data_ranks"])
    assert relative(result["losses"], reference) < 1e-5, (result["losses"], reference)


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.extended], id=n) for n in REFUSED])
def test_refused_before_training_with_advice(launches, name):
    result = launches.result(name)
    assert "refused" in result, result
    assert REFUSED[name][3] in result["message"]

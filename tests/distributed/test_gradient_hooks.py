"""A user's gradient hooks get one process's numbers or a clear refusal, under every layout.

In one process ``p.grad`` is the whole gradient in ``on_before_optimizer_step``. Under tp it is
a shard, under ZeRO-1 a buffer averaged only in this rank's chunk (with bf16 parameters, this
rank's own unreduced gradient), under ZeRO-2 ``None``, under pp only this stage's parameters
exist. Before, ``torch.nn.utils.clip_grad_norm_(self.parameters(), c)`` clipped each rank by a
different norm (the reference model after 2 steps, clipping to 0.05: 1.5e-3 relative parameter
error under tp2, 3.6e-4 under pp2, 7.0e-4 under cp2, 6.6e-3 under ZeRO-2, where nothing was
clipped), and Lightning's ``grad_norm`` logged shard norms under tp (total 2.96 for 3.50), stage
0's parameters under pp, nothing under ZeRO-2, and crashed under ZeRO-3 ("data is not allocated
yet"): without a word, except the last.

Now each of those reads is refused at the first step with what to use instead
(lightning_5d.gradient_reads), ``lightning_5d.grad_norm`` gives one process's norms on every
rank, and element-wise work (clipping by value) and Trainer's clipping run unchanged and equal
one process (gradient_hooks.py).
"""

import math

import pytest

from tests_support import cases_through, parameter_vector_error

TP2, PP2 = {"tp": 2}, {"pp": 2, "pipeline": {"microbatches": 2}}
TP2_SP = {"tp": 2, "sequence_parallel": True}
REFUSED = {  # name: (case, words the message must hold)
    "tp2: Lightning's grad_norm": ({"layout": TP2, "hook": "lightning_grad_norm"}, ["tensor-parallel shard (1/2"]),
    "pp2: torch clip_grad_norm_": ({"layout": PP2, "hook": "torch_clip"}, ["under pp=2", "stage"]),
    "cp2 (zero=1): torch clip_grad_norm_": ({"layout": {"cp": 2}, "hook": "torch_clip"}, ["1/2 chunk (zero=1)"]),
    "dp2 zero=2: Lightning's grad_norm": ({"layout": {"zero": 2}, "hook": "lightning_grad_norm"},
                                          ["is None on this rank", "under zero=2", "optimizer's slices"]),
    "dp2 zero=3: Lightning's grad_norm": ({"layout": {"zero": 3}, "hook": "lightning_grad_norm"}, ["DTensor"]),
    "dp2 zero=2: torch clip_grad_value_": ({"layout": {"zero": 2}, "hook": "value_clip"}, ["is None on this rank"]),
    "MoE ep2 zero=3: Lightning's grad_norm": ({"layout": {"ep": 2, "zero": 3}, "hook": "lightning_grad_norm",
                                               "model": "tiny_moe"}, ["only this ep rank's experts (1/2"]),
    "tp2: a total norm in on_before_zero_grad": ({"layout": TP2, "hook": "norm_before_zero_grad"},
                                                 ["HookedLM.on_before_zero_grad", "tensor-parallel shard"]),
    "tp2, manual optimization: torch clip_grad_norm_": ({"layout": TP2, "hook": "manual_torch_clip"},
                                                        ["training_step after manual_backward", "tensor-parallel"]),
    # bf16: the module's .grad is this rank's own unreduced gradient; the averaged one is the master slice.
    "dp2 zero=1 bf16-mixed: torch clip_grad_value_": ({"layout": {"zero": 1}, "hook": "value_clip",
                                                       "precision": "bf16-mixed"}, ["own, unreduced gradient"]),
}  # fmt: skip
NORMS = {  # name: (case, one-process batch: the samples of all data ranks)
    "tp2+sp": ({"layout": TP2_SP, "hook": "l5d_grad_norm"}, 2),
    "tp2, inf-norm": ({"layout": TP2, "hook": "l5d_grad_norm", "norm": "inf"}, 2),
    "pp2": ({"layout": PP2, "hook": "l5d_grad_norm"}, 2),
    "cp2 (zero=1)": ({"layout": {"cp": 2}, "hook": "l5d_grad_norm"}, 2),
    "dp2 zero=2": ({"layout": {"zero": 2}, "hook": "l5d_grad_norm"}, 4),
    "dp2 zero=3": ({"layout": {"zero": 3}, "hook": "l5d_grad_norm"}, 4),
    # Each ep rank holds 2 of the 4 experts of each MoE block (2 data ranks, ZeRO-2 slices of 1 rank).
    "MoE ep2 zero=2": ({"layout": {"ep": 2, "zero": 2}, "hook": "l5d_grad_norm", "model": "tiny_moe"}, 4),
}
UNCHANGED = {  # element-wise work and Trainer's clipping: no refusal, one process's parameters
    "tp2: clip_grad_value_": {"layout": TP2, "hook": "value_clip"},
    "pp2: clip_grad_value_": {"layout": PP2, "hook": "value_clip"},
    "cp2 (zero=1): clip_grad_value_": {"layout": {"cp": 2}, "hook": "value_clip"},
    "pp2: Trainer(gradient_clip_val)": {"layout": PP2, "hook": "trainer_clip"},
    "tp2, manual optimization: self.clip_gradients": {"layout": TP2, "hook": "manual_lightning_clip"},
    "tp2, manual optimization, 2 batches per step": {"layout": TP2, "hook": "manual_accumulate", "steps": 4},
    # FSDP2's gradients are DTensors: torch's clip_grad_norm_ takes their global norm (right before too).
    "dp2 zero=3: torch clip_grad_norm_": {"layout": {"zero": 3}, "hook": "torch_clip"},
    # 2 replicas of one shard each: ZeRO-2's whole slice is read in place of the None .grad.
    "HSDP dp_replicate=2 zero=2: torch clip_grad_norm_": {"layout": {"dp_replicate": 2, "zero": 2},
                                                          "hook": "torch_clip"},
}
FOUR_RANKS = {
    "tp2+sp x dp2 zero=3": ({"layout": {**TP2_SP, "zero": 3}, "hook": "l5d_grad_norm"}, 4),
    "tp2 x pp2": ({"layout": {**TP2, **PP2}, "hook": "l5d_grad_norm"}, 2),
    # In on_after_backward SP's norm weights hold partial sums over tp (summed after it, under ZeRO-3).
    "tp2+sp x dp2 zero=3, in on_after_backward": ({"layout": {**TP2_SP, "zero": 3},
                                                    "hook": "l5d_grad_norm_after_backward"}, 4),
}
FOUR_RANKS_REFUSED = {
    "tp2+sp x dp2 zero=3, a norm weight in on_after_backward": {"layout": {**TP2_SP, "zero": 3},
                                                                "hook": "norm_weight_after_backward"},
}
ONE_PROCESS = {  # the references, and Lightning's grad_norm where one process's .grad is the gradient
    "norms b2": {"layout": {}, "hook": "l5d_grad_norm"},
    "norms b4": {"layout": {}, "hook": "l5d_grad_norm", "batch": 4},
    "moe norms b4": {"layout": {}, "hook": "l5d_grad_norm", "batch": 4, "model": "tiny_moe"},
    "inf b2": {"layout": {}, "hook": "l5d_grad_norm", "norm": "inf"},
    "lightning b2": {"layout": {}, "hook": "lightning_grad_norm"},
    "value clip b2": {"layout": {}, "hook": "value_clip"},
    "trainer clip b2": {"layout": {}, "hook": "trainer_clip"},
    "torch clip b4": {"layout": {}, "hook": "torch_clip", "batch": 4},
    "manual torch clip b2": {"layout": {}, "hook": "manual_torch_clip"},
    "manual lightning clip b2": {"layout": {}, "hook": "manual_lightning_clip"},
    "manual accumulate b2": {"layout": {}, "hook": "manual_accumulate", "steps": 4},
    # bf16-mixed: the gradient is moved into the fp32 master before the hook (.grad was None):
    "bf16 lightning": {"layout": {}, "hook": "lightning_grad_norm", "precision": "bf16-mixed"},
    "bf16 l5d": {"layout": {}, "hook": "l5d_grad_norm", "precision": "bf16-mixed"},
    "bf16 torch clip": {"layout": {}, "hook": "torch_clip", "precision": "bf16-mixed"},
    "after backward b4": {"layout": {}, "hook": "l5d_grad_norm_after_backward", "batch": 4},
    "bf16 manual accumulate": {"layout": {}, "hook": "manual_accumulate", "precision": "bf16-mixed", "steps": 3},
    "bf16 trainer clip": {"layout": {}, "hook": "trainer_clip", "precision": "bf16-mixed"},
}
REFERENCE = {"value_clip": "value clip b2", "trainer_clip": "trainer clip b2", "torch_clip": "torch clip b4",
             "manual_lightning_clip": "manual lightning clip b2",
             "manual_accumulate": "manual accumulate b2"}  # fmt: skip


def run_cases(tmp_path, cases: dict, nproc: int) -> dict:
    return cases_through("gradient_hooks.py", tmp_path, cases, nproc, timeout=240)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return run_cases(tmp_path_factory.mktemp("one"), ONE_PROCESS, 1)


def assert_same_norms(name: str, got: dict, expected: dict, parameters: int = 21) -> None:
    norms = {k: v for k, v in expected.items() if "norm" in k}
    # The model's parameters and the total; the last block's (named in it) and their total.
    every = [k for k in norms if not k.startswith("last_block/") and not k.endswith("_total")]
    block = [k for k in norms if k.startswith("last_block/") and not k.endswith("_total")]
    assert len(every) == parameters, name
    if block:  # the hooks in on_before_optimizer_step also log the last block's
        assert [k.split(":", 1)[1] for k in block] == [
            k.split("model.layers.1.", 1)[1] for k in every if "model.layers.1." in k
        ], name
    assert {k: v for k, v in got.items() if "norm" in k}.keys() == norms.keys(), name
    for key, value in norms.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-7), f"{name}: {key}"


@pytest.mark.distributed
@pytest.mark.timeout(360)
def test_gradient_hooks_on_two_ranks(tmp_path, one_process):
    results = run_cases(tmp_path, {**{k: c for k, (c, _) in REFUSED.items()}, **{k: c for k, (c, _) in NORMS.items()},
                                   **UNCHANGED}, 2)  # fmt: skip
    for name, (_, words) in REFUSED.items():
        error = results[name].get("error")
        assert error is not None, f"{name}: trained without a word"
        for expected in [*words, "lightning_5d.grad_norm", "gradient_clip_val"]:
            assert expected in error, f"{name}: {expected!r} not in {error!r}"
    for name, (case, batch) in NORMS.items():
        moe = case.get("model") == "tiny_moe"  # 2 blocks of 4 experts x 3 projections, a router, a shared expert
        reference = one_process["moe norms b4" if moe else "inf b2" if case.get("norm") == "inf" else f"norms b{batch}"]
        assert "error" not in results[name], results[name].get("error")
        assert_same_norms(name, results[name]["metrics"], reference["metrics"], parameters=47 if moe else 21)
    for name, case in UNCHANGED.items():
        reference = one_process[REFERENCE[case["hook"]]]
        assert "error" not in results[name], results[name].get("error")
        assert parameter_vector_error(results[name]["params"], reference["params"]) <= 1e-5, name


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(360)
def test_grad_norm_on_four_ranks(tmp_path, one_process):
    results = run_cases(tmp_path, {**{k: c for k, (c, _) in FOUR_RANKS.items()}, **FOUR_RANKS_REFUSED}, 4)
    for name, (case, batch) in FOUR_RANKS.items():
        assert "error" not in results[name], results[name].get("error")
        reference = "after backward b4" if case["hook"].endswith("after_backward") else f"norms b{batch}"
        assert_same_norms(name, results[name]["metrics"], one_process[reference]["metrics"])
    for name in FOUR_RANKS_REFUSED:
        assert "this rank's partial sum, which tp adds" in results[name].get("error", ""), name


@pytest.mark.distributed
@pytest.mark.timeout(360)
def test_one_process_grad_norm_is_lightnings(one_process):
    # Where one process's .grad is the whole gradient, lightning_5d.grad_norm is Lightning's grad_norm.
    for ours, theirs in (("norms b2", "lightning b2"), ("bf16 l5d", "bf16 lightning")):
        mine = {k: v for k, v in one_process[ours]["metrics"].items() if k.startswith("grad_")}
        lightning = {k: v for k, v in one_process[theirs]["metrics"].items() if k.startswith("grad_")}
        assert mine.keys() == lightning.keys() and len(mine) == 22
        for key, value in lightning.items():
            assert mine[key] == pytest.approx(value, rel=1e-6), f"{ours}: {key}"
    # Clipping by hand equals Lightning's clipping in one process; under bf16-mixed too, where the
    # gradients sit in the fp32 masters by then (.grad was None: nothing was clipped, 5.2e-3 off).
    pairs = (("manual torch clip b2", "manual lightning clip b2"), ("bf16 torch clip", "bf16 trainer clip"))
    for mine, lightnings in pairs:
        assert parameter_vector_error(one_process[mine]["params"], one_process[lightnings]["params"]) <= 1e-6, mine
    # Manual optimization stepping every 2 batches under bf16-mixed on CPU (Lightning's step context
    # enters a mode of its own around the step): torch's mode stack stays as it was.
    depths = one_process["bf16 manual accumulate"]["mode_stack_depths"]
    assert len(depths) == 6 and len(set(depths)) == 1 and one_process["bf16 manual accumulate"]["mode_stack_after"] == 0
    inf = one_process["inf b2"]["metrics"]
    two = one_process["norms b2"]["metrics"]
    per_parameter = [v for k, v in inf.items() if k.startswith("grad_inf_norm/")]
    assert inf["grad_inf_norm_total"] == max(per_parameter)
    squares = sum(v**2 for k, v in two.items() if k.startswith("grad_2.0_norm/"))
    assert two["grad_2.0_norm_total"] == pytest.approx(math.sqrt(squares), rel=1e-6)

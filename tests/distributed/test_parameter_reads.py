"""A training_step that computes with the parameters themselves gets one process's numbers or a clear refusal.

Before, a term computed from the parameters and added to the loss trained without a word under
tp2 (a mean-of-squares penalty on the embedding shard: 1.8e-3 relative parameter error after 3
steps), tp2 with SP (a penalty on a norm weight whose gradient tp sums: that weight 0.30 off with
SGD), ep2 (a penalty over self.parameters(): 4.8e-2) and pp2 (7.3e-2; a penalty on layers[0],
which the last stage sees as its own first block: 0.17), and crashed inside
torch's backward under ZeRO-3 ("got mixed torch.Tensor and DTensor"). Now each is refused at the
first step with what to do instead (lightning_5d.parameter_reads); the same step where every
parameter it reads is whole here (cp, ZeRO-2, one parameter on its pp stage, a replicated
parameter under tp, ZeRO-3's DTensor value made whole by ``.full_tensor()``) and element-wise work
(an EMA) train as one process does.
"""


import pytest

from tests_support import cases_through, parameter_vector_error

TP2, PP2 = {"tp": 2}, {"pp": 2, "pipeline": {"microbatches": 2}}
REFUSED = {  # name: (case, words the message must hold)
    "tp2: an L2 penalty over self.parameters()": ({"layout": TP2, "term": "l2"}, ["tensor-parallel shard (1/2"]),
    "tp2: logits from the head's weight in the step": ({"layout": TP2, "term": "head_logits"},
                                                       ["model.lm_head.weight", "tensor-parallel shard"]),
    "tp2+SP: a penalty on a norm weight tp sums": ({"layout": {**TP2, "sequence_parallel": True},
                                                    "term": "block_norm_l2", "optimizer": "sgd"},
                                                   ["model.layers.0.attention_norm.weight", "count 2 times"]),
    "pp2: an L2 penalty over self.parameters()": ({"layout": PP2, "term": "l2"}, ["last stage's blocks"]),
    # The last stage sees its blocks re-keyed from 0: layers[0] there is block 1 (before: 0.17 off, silently).
    "pp2: a penalty on layers[0]'s norm weight": ({"layout": PP2, "term": "block_norm_l2", "optimizer": "sgd"},
                                                  ["model.layers.1.attention_norm.weight", "indexed from 0"]),
    "dp2 zero=3: an L2 penalty over self.parameters()": ({"layout": {"zero": 3}, "term": "l2"},
                                                         ["a DTensor under ZeRO-3"]),
    "MoE ep2: an L2 penalty over self.parameters()": ({"layout": {"ep": 2}, "term": "l2", "model": "tiny_moe"},
                                                      ["only this ep rank's experts (1/2"]),
}  # fmt: skip
UNCHANGED = {  # name: (case, the one-process case it must match)
    "cp2: an L2 penalty": ({"layout": {"cp": 2}, "term": "l2"}, "l2 b2"),
    "dp2 zero=2: an L2 penalty": ({"layout": {"zero": 2}, "term": "l2"}, "l2 b4"),
    "pp2: a penalty on the final norm (the last stage's)": ({"layout": PP2, "term": "norm_l2"}, "norm b2"),
    "tp2: a penalty on the final norm (replicated)": ({"layout": TP2, "term": "norm_l2"}, "norm b2"),
    "tp2: an EMA of every parameter": ({"layout": TP2, "term": "ema"}, "ema b2"),
    # The DTensor value made whole by .full_tensor() (SGD: a gradient counted twice would show).
    "dp2 zero=3: a penalty .full_tensor()'d": ({"layout": {"zero": 3}, "term": "first_block_l2", "optimizer": "sgd"},
                                               "first block b4"),
}
ONE_PROCESS = {
    "l2 b2": {"layout": {}, "term": "l2"},
    "l2 b4": {"layout": {}, "term": "l2", "batch": 4},
    "norm b2": {"layout": {}, "term": "norm_l2"},
    "ema b2": {"layout": {}, "term": "ema"},
    "first block b4": {"layout": {}, "term": "first_block_l2", "optimizer": "sgd", "batch": 4},
}


def run_cases(tmp_path, cases: dict, nproc: int) -> dict:
    return cases_through("parameter_reads.py", tmp_path, cases, nproc)


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_parameter_reads_in_the_step_on_two_ranks(tmp_path):
    one = run_cases(tmp_path, ONE_PROCESS, 1)
    results = run_cases(tmp_path, {**{k: c for k, (c, _) in REFUSED.items()},
                                   **{k: c for k, (c, _) in UNCHANGED.items()}}, 2)  # fmt: skip
    for name, (_, words) in REFUSED.items():
        error = results[name].get("error")
        assert error is not None, f"{name}: trained without a word"
        for expected in [*words, "ParameterReadError", "weight_decay"]:
            assert expected in error, f"{name}: {expected!r} not in {error!r}"
    for name, (_, reference) in UNCHANGED.items():
        assert "error" not in results[name], results[name].get("error")
        assert parameter_vector_error(results[name]["params"], one[reference]["params"]) <= 1e-5, name

"""nn.MultiheadAttention's forward built from its parts (``mha_parts``) equals torch's, in fp32 within
1e-6, over the options the module takes and the calls it accepts: outputs, returned weights, and the
gradients of the inputs and every parameter."""

import copy
import functools
import threading

import pytest
import torch
from torch import nn

from lightning_5d.mha_parts import MhaPartsError, own_forward, parts_of

E, H, L, S, N = 16, 4, 5, 7, 3


def _modules(seed: int = 0, **options):
    torch.manual_seed(seed)
    torch_mha = nn.MultiheadAttention(E, H, **options)
    with torch.no_grad():  # nonzero biases, so a bias in the wrong place shows
        for name, p in torch_mha.named_parameters():
            if "bias" in name:
                p.normal_()
    ours = copy.deepcopy(torch_mha)
    own_forward(ours)
    return torch_mha, ours


def _mask(kind: str, tgt: int, src: int, batch: int):
    g = torch.Generator().manual_seed(3)
    if kind == "bool2d":
        return torch.rand(tgt, src, generator=g) > 0.7
    if kind == "float2d":
        return torch.randn(tgt, src, generator=g)
    if kind == "bool3d":
        return torch.rand(batch * H, tgt, src, generator=g) > 0.7
    if kind == "float3d":
        return torch.randn(batch * H, tgt, src, generator=g)
    if kind == "causal":
        return nn.Transformer.generate_square_subsequent_mask(tgt)
    return None


def _padding(kind: str, batch: int, src: int):
    if kind == "none":
        return None
    pad = torch.zeros(batch, src, dtype=torch.bool)
    pad[0, -2:] = True
    return pad if kind == "bool" else torch.zeros(batch, src).masked_fill(pad, float("-inf"))


def _compare(torch_mha, ours, inputs, **kwargs):
    outs = []
    for module in (torch_mha, ours):
        leaves = [t.clone().requires_grad_() for t in inputs]
        q, k, v = (leaves * 3)[:3] if len(leaves) == 1 else (leaves[0], leaves[1], leaves[1 if len(leaves) == 2 else 2])
        out, weights = module(q, k, v, **kwargs)
        loss = out.square().sum() + (0 if weights is None else weights.square().sum())
        loss.backward()
        outs.append((out, weights, [t.grad for t in leaves], {n: p.grad for n, p in module.named_parameters()}))
    (o1, w1, g1, p1), (o2, w2, g2, p2) = outs
    assert (w1 is None) == (w2 is None) and p1.keys() == p2.keys()
    pairs = [("output", o2, o1)] + [("input grad", a, b) for a, b in zip(g2, g1)]
    pairs += [(name, p2[name], p1[name]) for name in p1] + ([("weights", w2, w1)] if w1 is not None else [])
    for name, got, expected in pairs:
        # fp32 within 1e-6 of the tensor's scale (a gradient of magnitude 14 carries ~1e-6 of rounding)
        assert (got - expected).abs().max() <= 1e-6 * max(1.0, expected.abs().max().item()), name


OPTIONS = {
    "plain": {},
    "batch_first": {"batch_first": True},
    "no bias": {"bias": False, "batch_first": True},
    "bias_kv": {"add_bias_kv": True},
    "zero_attn": {"add_zero_attn": True, "batch_first": True},
    "bias_kv+zero_attn": {"add_bias_kv": True, "add_zero_attn": True},
}
# (attn_mask, key_padding_mask): every mask form torch takes, bool with bool and float with float
MASKS = [("none", "none"), ("bool2d", "bool"), ("float2d", "float"), ("bool3d", "none"), ("float3d", "float")]
WEIGHTS = [(False, True), (True, True), (True, False)]  # (need_weights, average_attn_weights)


FAST_OPTIONS = ("batch_first", "bias_kv+zero_attn")  # the default tier; the rest on demand (-m extended)


@pytest.mark.parametrize(
    "option", [o if o in FAST_OPTIONS else pytest.param(o, marks=pytest.mark.extended) for o in OPTIONS]
)
def test_self_attention_equals_torch_over_options_masks_and_weights(option):
    options = OPTIONS[option]
    torch_mha, ours = _modules(**options)
    batch_first = options.get("batch_first", False)
    x = torch.randn((N, L, E) if batch_first else (L, N, E))
    for i, (mask, pad) in enumerate(MASKS):
        kwargs = {"attn_mask": _mask(mask, L, L, N), "key_padding_mask": _padding(pad, N, L)}
        for need_weights, average in (WEIGHTS if i == 0 else [WEIGHTS[i % 3]]):
            _compare(torch_mha, ours, [x], need_weights=need_weights, average_attn_weights=average, **kwargs)


@pytest.mark.parametrize(
    "batch_first,need_weights,padding", [(True, False, "none"), (False, True, "none"), (True, False, "bool")]
)
def test_is_causal_with_its_mask_equals_torch(batch_first, need_weights, padding):
    torch_mha, ours = _modules(batch_first=batch_first)
    x = torch.randn((N, L, E) if batch_first else (L, N, E))
    kwargs = {"attn_mask": _mask("causal", L, L, N), "is_causal": True, "key_padding_mask": _padding(padding, N, L)}
    if padding == "bool":
        kwargs["attn_mask"] = kwargs["attn_mask"] != 0  # torch deprecates mixing mask types
    _compare(torch_mha, ours, [x], need_weights=need_weights, **kwargs)
    with pytest.raises(RuntimeError, match="Need attn_mask"):
        ours(x, x, x, is_causal=True)


@pytest.mark.parametrize(
    "inputs,option,need_weights",
    [("kv shared", "bias_kv", True), ("all distinct", "separate weights", False),
     pytest.param("kv shared", "plain", False, marks=pytest.mark.extended),
     pytest.param("all distinct", "batch_first", False, marks=pytest.mark.extended),
     pytest.param("all distinct", "separate weights", True, marks=pytest.mark.extended)],
)  # fmt: skip
def test_cross_attention_equals_torch(inputs, option, need_weights):
    options = {"kdim": 12, "vdim": 10} if option == "separate weights" else OPTIONS[option]
    torch_mha, ours = _modules(seed=1, **options)
    batch_first = options.get("batch_first", False)
    shape = (lambda n, e: (N, n, e)) if batch_first else (lambda n, e: (n, N, e))
    kdim, vdim = options.get("kdim", E), options.get("vdim", E)
    q = torch.randn(shape(L, E))
    if inputs == "kv shared" and kdim == vdim:
        tensors = [q, torch.randn(shape(S, kdim))]
    else:
        tensors = [q, torch.randn(shape(S, kdim)), torch.randn(shape(S, vdim))]
    for mask, pad in MASKS[1:4]:
        kwargs = {"attn_mask": _mask(mask, L, S, N), "key_padding_mask": _padding(pad, N, S)}
        _compare(torch_mha, ours, tensors, need_weights=need_weights, **kwargs)


@pytest.mark.parametrize("need_weights", [False, True])
def test_unbatched_inputs_equal_torch(need_weights):
    torch_mha, ours = _modules(batch_first=True)  # ignored for unbatched inputs, as torch does
    x = torch.randn(L, E)
    for mask in ["none", "bool2d", "float2d"]:
        pad = torch.tensor([False] * (L - 1) + [True]) if mask == "bool2d" else None
        _compare(torch_mha, ours, [x], need_weights=need_weights, attn_mask=_mask(mask, L, L, 1), key_padding_mask=pad)


@pytest.mark.parametrize("need_weights", [False, True])
def test_dropout_in_training_draws_as_torch_does(need_weights):
    torch_mha, ours = _modules(dropout=0.3, batch_first=True)
    x = torch.randn(N, L, E)
    for module in (torch_mha, ours):
        module.train()
    outs = []
    for module in (torch_mha, ours):
        torch.manual_seed(7)
        outs.append(module(x, x, x, need_weights=need_weights)[0])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)
    ours.eval()
    torch_mha.eval()
    _compare(torch_mha, ours, [x], need_weights=need_weights)  # eval: no dropout


def test_settings_are_kept_once_and_a_refusal_names_its_reason():
    _, ours = _modules(batch_first=True)
    parts = own_forward(ours)
    assert own_forward(ours) is parts is parts_of(ours)
    x = torch.randn(N, L, E)
    parts.weights_refused["tp"] = "tp=2 holds 2 of 4 heads; pass need_weights=False."
    with pytest.raises(MhaPartsError, match="need_weights=False"):
        ours(x, x, x)
    assert ours(x, x, x, need_weights=False)[1] is None
    parts.masks = functools.partial(lambda lock, *a: a[:1] + a[2:3], threading.Lock())  # as cp's rule: not copyable
    clone = copy.deepcopy(ours)  # the copy runs its own parameters, and shares the rule
    assert parts_of(clone).masks is parts.masks and parts_of(clone).weights_refused == parts.weights_refused
    with torch.no_grad():
        clone.out_proj.bias.add_(1.0)
    torch.testing.assert_close(clone(x, x, x, need_weights=False)[0], ours(x, x, x, need_weights=False)[0] + 1.0)


def test_the_fused_encoder_layer_path_is_off_so_the_parts_run():
    """nn.TransformerEncoderLayer in eval without gradients takes torch's fused path, which never calls
    the attention's forward; own_forward's hook turns that path off."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True).eval()
    reference = copy.deepcopy(layer)
    calls = []
    own_forward(layer.self_attn)
    layer.self_attn.out_proj.register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(N, L, E)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), reference(x), rtol=1e-6, atol=1e-6)
    assert calls == [1]


def test_the_nested_inference_input_of_transformer_encoder_equals_torch():
    """In eval without gradients nn.TransformerEncoder turns a padded batch into nested tensors; torch
    takes them on its fused path only, the parts forward pads them and masks the padding."""
    torch.manual_seed(0)
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True), 2).eval()
    reference = copy.deepcopy(encoder)
    for layer in encoder.layers:
        own_forward(layer.self_attn)
    x, padding = torch.randn(N, L, E), torch.zeros(N, L, dtype=torch.bool)
    padding[1, -2:] = True
    with torch.no_grad():
        got, expected = encoder(x, src_key_padding_mask=padding), reference(x, src_key_padding_mask=padding)
    assert (got - expected).abs().max() <= 1e-6 * expected.abs().max()

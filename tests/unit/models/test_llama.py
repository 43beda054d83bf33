"""Reference model: shapes, causality, RoPE positions, GQA, MoE, parameter count, training."""

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from lightning_5d.models import LlamaConfig, LlamaLM, LlamaModel
from lightning_5d.models.llama import apply_rope, rope_cos_sin

TINY = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=64)


def make_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return LlamaModel(LlamaConfig(**{**TINY, **overrides})).eval()


def ids(b=2, s=16, seed=1):
    return torch.randint(0, 256, (b, s), generator=torch.Generator().manual_seed(seed))


def test_logits_shape():
    model = make_model()
    assert model(ids(3, 10)).shape == (3, 10, 256)


def test_causal():
    model = make_model()
    x = ids(2, 16)
    y = x.clone()
    y[:, 10] = (y[:, 10] + 1) % 256
    a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_default_positions_are_arange():
    model = make_model()
    x = ids(2, 12)
    torch.testing.assert_close(model(x), model(x, torch.arange(12)), rtol=0, atol=0)
    torch.testing.assert_close(model(x), model(x, torch.arange(12).expand(2, 12)), rtol=0, atol=0)


def test_positions_are_honoured():
    # Larger init: with std 0.02 attention is nearly uniform and positions barely show.
    model = make_model(init_std=0.2)
    x = ids(2, 12)
    ref = model(x)
    # RoPE encodes relative offsets: a constant shift leaves attention unchanged...
    torch.testing.assert_close(model(x, torch.arange(12) + 37), ref, rtol=1e-4, atol=1e-4)
    # ...but changing the gaps between positions changes the output.
    assert (model(x, torch.arange(12) * 2) - ref).abs().max() > 0.1
    # Per-sample positions: row 0 normal, row 1 stretched.
    pos = torch.stack([torch.arange(12), torch.arange(12) * 2])
    out = model(x, pos)
    torch.testing.assert_close(out[0], ref[0], rtol=0, atol=0)
    assert (out[1] - ref[1]).abs().max() > 0.1


def test_first_chunk_with_true_positions_matches_full_run():
    model = make_model()
    x = ids(2, 16)
    torch.testing.assert_close(model(x[:, :6], torch.arange(6)), model(x)[:, :6], rtol=1e-5, atol=1e-5)


def test_rope_on_a_shard_equals_shard_of_rope():
    # What context parallelism relies on: any slice of q/k rotated with its true
    # positions equals the same slice of the full-sequence rotation.
    q = torch.randn(2, 16, 4, 8)
    full = apply_rope(q, *rope_cos_sin(torch.arange(16), 8, 10000.0))
    pos = torch.arange(12, 16)
    torch.testing.assert_close(apply_rope(q[:, 12:], *rope_cos_sin(pos, 8, 10000.0)), full[:, 12:])


def test_tied_embeddings_share_one_parameter():
    untied, tied = make_model(), make_model(tie_embeddings=True)
    assert tied.lm_head.weight is tied.embed_tokens.weight
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert n(untied) - n(tied) == 256 * TINY["hidden_size"]
    tied(ids()).sum().backward()
    assert tied.embed_tokens.weight.grad is not None


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_gqa_equals_mha_with_repeated_kv_weights(kv_heads):
    # A GQA model must equal an MHA model whose k/v heads are copies: query head i
    # reads kv head i // (heads / kv_heads).
    gqa = make_model(num_kv_heads=kv_heads)
    mha = make_model(num_kv_heads=4)
    sd = gqa.state_dict()
    d, rep = gqa.config.head_dim, 4 // kv_heads
    for k, v in sd.items():
        if k.endswith(("k_proj.weight", "v_proj.weight")):
            sd[k] = v.view(kv_heads, d, -1).repeat_interleave(rep, dim=0).reshape(4 * d, -1)
    mha.load_state_dict(sd)
    x = ids()
    torch.testing.assert_close(gqa(x), mha(x), rtol=1e-5, atol=1e-5)


def _moe_reference(moe, x):
    """Token-by-token loop: the obvious definition the vectorized MoE must match."""
    flat = x.reshape(-1, x.size(-1))
    out = []
    for t in flat:
        p = F.softmax(moe.router(t).float(), -1)
        w, i = p.topk(moe.top_k)
        w = w / w.sum()
        y = sum(wj * moe.experts[int(j)](t) for wj, j in zip(w, i))
        if moe.shared_experts is not None:
            y = y + moe.shared_experts(t)
        out.append(y)
    return torch.stack(out).view_as(x)


@pytest.mark.parametrize("shared", [0, 1])
def test_moe_matches_token_loop_and_every_expert_learns(shared):
    model = make_model(num_experts=4, experts_top_k=2, moe_intermediate_size=16, num_shared_experts=shared)
    block = model.layers[0]
    assert not hasattr(block, "mlp") and len(block.moe.experts) == 4
    assert (block.moe.shared_experts is not None) == bool(shared)
    if shared:
        assert block.moe.shared_experts.gate_proj.out_features == shared * 16

    h = torch.randn(2, 8, TINY["hidden_size"])
    torch.testing.assert_close(block.moe(h), _moe_reference(block.moe, h), rtol=1e-5, atol=1e-5)

    model(ids(4, 32)).logsumexp(-1).mean().backward()
    for layer in model.layers:
        # 128 tokens x top-2 over 4 experts: every expert receives traffic.
        for e in layer.moe.experts:
            assert e.down_proj.weight.grad.abs().sum() > 0
        assert layer.moe.router.weight.grad.abs().sum() > 0


def test_moe_expert_without_tokens_still_gets_a_grad():
    # An expert that receives no token gets a zero grad, not None: no unused params.
    model = make_model(num_experts=4, experts_top_k=1)
    moe = model.layers[0].moe
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0] = 10.0  # route every (positive-sum) token to expert 0
    moe(torch.ones(1, 4, TINY["hidden_size"])).sum().backward()
    assert moe.experts[0].up_proj.weight.grad.abs().sum() > 0
    assert moe.experts[3].up_proj.weight.grad is not None
    assert moe.experts[3].up_proj.weight.grad.abs().sum() == 0


def expected_params(c: LlamaConfig) -> int:
    h, d = c.hidden_size, c.hidden_size // c.num_heads
    attn = h * c.num_heads * d * 2 + h * c.num_kv_heads * d * 2  # q, o + k, v
    if c.num_experts:
        inter = c.moe_intermediate_size or c.intermediate_size
        ff = h * c.num_experts + 3 * h * inter * (c.num_experts + c.num_shared_experts)
    else:
        ff = 3 * h * c.intermediate_size
    per_layer = attn + ff + 2 * h  # two norms
    head = 0 if c.tie_embeddings else c.vocab_size * h
    return c.vocab_size * h + c.num_layers * per_layer + h + head


@pytest.mark.parametrize(
    "cfg",
    [
        LlamaConfig(),
        LlamaConfig(tie_embeddings=True),
        LlamaConfig(num_experts=8, moe_intermediate_size=64, num_shared_experts=1),
    ],
    ids=["default", "tied", "moe"],
)
def test_param_count(cfg):
    model = LlamaModel(cfg)
    assert sum(p.numel() for p in model.parameters()) == expected_params(cfg)
    if cfg == LlamaConfig():
        assert expected_params(cfg) == 853_120


def test_init_deterministic_and_as_specified():
    a, b = make_model(seed=3), make_model(seed=3)
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(va, vb, rtol=0, atol=0, msg=k)
    assert torch.equal(a.norm.weight, torch.ones_like(a.norm.weight))
    assert a.lm_head.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert not torch.equal(make_model(seed=4).embed_tokens.weight, a.embed_tokens.weight)
    # Meta-device build + re-init reproduces the eager init from the same seed.
    with torch.device("meta"):
        m = LlamaModel(a.config)
    m.to_empty(device="cpu")
    torch.manual_seed(3)
    m.init_weights()
    for (k, va), vm in zip(a.state_dict().items(), m.state_dict().values()):
        torch.testing.assert_close(va, vm, rtol=0, atol=0, msg=k)


def test_bf16_forward_keeps_dtype():
    model = make_model().to(torch.bfloat16)
    assert model(ids()).dtype == torch.bfloat16


def test_config_validation():
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        LlamaConfig(num_heads=8, num_kv_heads=3)
    with pytest.raises(ValueError, match="experts_top_k=3"):
        LlamaConfig(num_experts=2, experts_top_k=3)


def test_lm_accepts_dict_config_and_shifts_when_labels_missing():
    torch.manual_seed(0)
    lm = LlamaLM(TINY)
    assert isinstance(lm.hparams.config, dict) and lm.model.config == LlamaConfig(**TINY)
    x = ids(2, 17)
    with_labels = lm._loss({"input_ids": x[:, :-1], "labels": x[:, 1:]})
    torch.testing.assert_close(lm._loss({"input_ids": x}), with_labels)
    assert with_labels.item() == pytest.approx(math.log(256), rel=0.05)  # near-uniform at init


def test_optimizers_and_warmup():
    lm = LlamaLM(TINY, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.9))
    opt = lm.configure_optimizers()
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.defaults["betas"] == (0.8, 0.9) and opt.defaults["weight_decay"] == 0.1
    cfg = LlamaLM(TINY, lr=1e-2, warmup_steps=4).configure_optimizers()
    assert cfg["lr_scheduler"]["interval"] == "step"
    opt, sched = cfg["optimizer"], cfg["lr_scheduler"]["scheduler"]
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2, 1e-2, 1e-2])


def test_three_step_fit_and_checkpoint_roundtrip(tmp_path):
    from lightning_5d.models import TextDataModule

    L.seed_everything(0, verbose=False)
    lm = LlamaLM(TINY, warmup_steps=2)
    before = lm.model.embed_tokens.weight.detach().clone()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=1,  # also exercises validation_step
    )
    trainer.fit(lm, TextDataModule(seq_len=32, batch_size=2, val_samples=2))
    assert trainer.global_step == 3
    assert torch.isfinite(trainer.callback_metrics["train_loss"])
    assert not torch.equal(before, lm.model.embed_tokens.weight)

    path = tmp_path / "lm.ckpt"
    trainer.save_checkpoint(path)
    torch.load(path, weights_only=True)  # hparams are plain data, no pickled classes
    loaded = LlamaLM.load_from_checkpoint(path)
    x = ids()
    torch.testing.assert_close(loaded.eval()(x), lm.eval()(x), rtol=0, atol=0)

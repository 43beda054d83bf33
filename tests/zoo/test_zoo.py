"""The zoo's models themselves: seeded builds are identical (every rank starts from the same
weights) and each is a causal LM (changing token t changes no logit before t)."""

import lightning as L
import pytest
import torch

import zoo


@pytest.mark.parametrize("name", [*zoo.MODELS, *zoo.VARIANTS])
def test_zoo_model_is_a_seeded_causal_lm(name):
    if name in zoo.HUGGING_FACE:
        pytest.importorskip("transformers")
    if name in ("einops_style", "einops_sdpa"):
        pytest.importorskip("einops")
    L.seed_everything(0, verbose=False)
    model = zoo.build(name).eval()
    L.seed_everything(0, verbose=False)
    again = zoo.build(name)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    y = x.clone()
    y[:, 10] = (y[:, 10] + 1) % 256
    with torch.no_grad():
        a, b = model.logits(x), model.logits(y)
    assert a.shape == (2, 16, 256)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_unknown_name_lists_the_zoo():
    with pytest.raises(KeyError, match="nanogpt"):
        zoo.build("gpt5")


@pytest.mark.parametrize("variant, original", [("alternating_sdpa", "alternating"), ("einops_sdpa", "einops_style"),
                                               ("plain_torch_positions", "plain_torch")])  # fmt: skip
def test_a_variant_computes_what_its_original_computes(variant, original):
    """A variant only follows a refusal's advice: the same weights and the same logits."""
    if "einops" in original:
        pytest.importorskip("einops")
    L.seed_everything(0, verbose=False)
    a = zoo.build(original).eval()
    L.seed_everything(0, verbose=False)
    b = zoo.build(variant).eval()
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(b.logits(x), a.logits(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", [*zoo.MODELS])
def test_a_meta_build_recomputes_the_eager_values_or_is_refused(name):
    """Built on the meta device under the recorder (chunked draws included), every tensor replays to the
    eager build's value from the same seed and the generator ends where the eager build leaves it; a model
    the recording cannot reproduce must be refused by name, never given other values."""
    from lightning_5d.materialize import InitLog, MaterializeError, Replay, recording
    from lightning_5d.materialize.apply import capture

    if name in zoo.HUGGING_FACE:
        pytest.importorskip("transformers")
    if name == "einops_style":
        pytest.importorskip("einops")
    L.seed_everything(0, verbose=False)
    eager = zoo.build(name)
    after_eager = torch.rand(3)
    L.seed_everything(0, verbose=False)
    log = InitLog()
    with recording(log):
        meta = zoo.build(name)
    assert torch.equal(torch.rand(3), after_eager)
    try:
        refs = capture(meta, log)
    except MaterializeError as refusal:
        assert "initialize" in str(refusal).lower()
        return
    expected = {**dict(eager.named_parameters(remove_duplicate=False)), **dict(eager.named_buffers())}
    replay = Replay(log)
    for ref_name, ref in refs.items():
        assert torch.equal(replay.value(ref), expected[ref_name]), ref_name


@pytest.mark.parametrize("name", [*zoo.MODELS, *zoo.VARIANTS])
def test_a_meta_build_is_discovered_as_its_eager_build(name):
    """Discovery's probe forwards on a meta build compute with the recorded values
    (lightning_5d/materialize/stand_in.py), so every zoo style gets the plan its eager build gets:
    fused layouts, position reads, shape sites, loose parameters, attention traced to its linears.
    Without them 10 of these 18 plans differed or were refused (GPT-NeoX's per-head interleaved
    query_key_value cut as [q|k|v]; nested blocks with no attention found)."""
    from dataclasses import replace

    from lightning_5d.materialize import InitLog, recording
    from lightning_5d.materialize.apply import capture
    from lightning_5d.materialize.stand_in import recorded_values
    from lightning_5d.plan import discover

    if name in zoo.HUGGING_FACE:
        pytest.importorskip("transformers")
    if "einops" in name:
        pytest.importorskip("einops")
    L.seed_everything(0, verbose=False)
    expected = discover(zoo.build(name))
    L.seed_everything(0, verbose=False)
    log = InitLog()
    with recording(log):
        meta = zoo.build(name)
    capture(meta, log)
    plan = discover(meta, values=lambda: recorded_values(meta, log))
    assert replace(plan, notes=()) == replace(expected, notes=())
    assert all(p.is_meta for p in meta.parameters())

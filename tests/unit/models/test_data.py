"""Offline byte-level corpus, windowed dataset and DataModule."""

import time

import pytest
import torch

from lightning_5d.models import ByteTokenizer, TextDataModule, build_corpus
from lightning_5d.models.data import TokenDataset


def test_tokenizer_roundtrip():
    tok = ByteTokenizer()
    text = "Return the sum — of ünïcode."
    ids = tok.encode(text)
    assert tok.vocab_size == 256 and all(0 <= i < 256 for i in ids)
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text


def test_corpus_is_english_deterministic_and_long_enough():
    text = build_corpus()
    assert len(text.encode("utf-8")) >= 200_000
    assert text.count(" the ") > 1000  # real prose, not noise
    build_corpus.cache_clear()
    assert build_corpus() == text
    longer = build_corpus(3 * len(text.encode("utf-8")))
    assert len(longer.encode("utf-8")) >= 3 * len(text.encode("utf-8")) and longer.startswith(text)


def test_token_dataset_windows():
    tokens = torch.arange(100)
    ds = TokenDataset(tokens, seq_len=8)
    assert len(ds) == 99 // 8
    s = ds[3]
    assert s["input_ids"].tolist() == list(range(24, 32))
    assert s["labels"].tolist() == list(range(25, 33))
    assert s["input_ids"].dtype == torch.long
    wrapped = TokenDataset(tokens, seq_len=8, num_samples=30)
    assert len(wrapped) == 30 and torch.equal(wrapped[12]["input_ids"], ds[0]["input_ids"])
    with pytest.raises(IndexError):
        wrapped[30]
    with pytest.raises(ValueError, match="seq_len"):
        TokenDataset(torch.arange(5), seq_len=8)


def _setup(**kw):
    dm = TextDataModule(**kw)
    dm.setup("fit")
    return dm


def test_datamodule_deterministic_and_aligned():
    t0 = time.perf_counter()
    a = _setup(seq_len=64, batch_size=4, val_samples=8)
    assert time.perf_counter() - t0 < 1.0
    b = _setup(seq_len=64, batch_size=4, val_samples=8)
    assert len(a.train_dataset) == len(b.train_dataset) and len(a.val_dataset) == 8
    for i in (0, 7, len(a.train_dataset) - 1):
        assert torch.equal(a.train_dataset[i]["input_ids"], b.train_dataset[i]["input_ids"])
    for ds in (a.train_dataset, a.val_dataset):
        s = ds[1]
        assert torch.equal(s["input_ids"][1:], s["labels"][:-1])  # labels = inputs shifted by one
        assert torch.equal(s["labels"][-1:], ds[2]["input_ids"][:1])  # windows are contiguous
    # Validation is the tail of the corpus, after every training window.
    corpus = torch.tensor(ByteTokenizer().encode(build_corpus()))
    val_start = corpus.numel() - (8 * 64 + 1)
    assert torch.equal(a.val_dataset[0]["input_ids"], corpus[val_start : val_start + 64])
    assert a.val_dataset[7]["labels"][-1] == corpus[-1]
    assert a.train_dataset.tokens.numel() == val_start + 1  # train ends where val starts

    torch.manual_seed(0)
    batch_a = next(iter(a.train_dataloader()))
    torch.manual_seed(0)
    batch_b = next(iter(b.train_dataloader()))
    assert batch_a["input_ids"].shape == (4, 64) and batch_a["labels"].shape == (4, 64)
    assert torch.equal(batch_a["input_ids"], batch_b["input_ids"])
    val = next(iter(a.val_dataloader()))
    assert torch.equal(val["input_ids"][0], a.val_dataset[0]["input_ids"])  # not shuffled


def test_datamodule_num_samples_and_loader_flags():
    dm = _setup(seq_len=32, batch_size=3, num_samples=10)
    assert len(dm.train_dataset) == 10
    train = dm.train_dataloader()
    assert train.drop_last and len(train) == 3
    assert isinstance(train.sampler, torch.utils.data.RandomSampler)
    assert isinstance(dm.val_dataloader().sampler, torch.utils.data.SequentialSampler)
    with pytest.raises(ValueError, match="val_samples=0"):
        TextDataModule(val_samples=0)

"""Byte-level text data for the reference model, built offline at run time.

The corpus is real English prose (standard-library docstrings), so losses behave like
language modelling rather than noise, yet nothing is downloaded. It is deterministic
for a given Python version; docstrings differ between versions, so golden numbers
must be recorded per Python version.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import warnings

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

# Fixed and sorted: the corpus must not depend on import order or on what happens to
# be imported already. Pure-Python, always-available modules with long docstrings.
CORPUS_MODULES = (
    "abc", "argparse", "ast", "base64", "bisect", "calendar", "collections", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "enum", "fractions",
    "functools", "gettext", "glob", "hashlib", "heapq", "hmac", "inspect", "io", "ipaddress",
    "itertools", "json", "logging", "math", "operator", "os", "pathlib", "pickle", "pprint",
    "queue", "random", "re", "shlex", "shutil", "socket", "statistics", "string", "struct",
    "subprocess", "tempfile", "textwrap", "threading", "time", "typing", "unittest",
    "urllib.parse", "uuid", "warnings", "weakref", "zipfile",
)  # fmt: skip


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, no special tokens, lossless on valid text."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def _docstrings(module_name: str):
    mod = importlib.import_module(module_name)
    yield inspect.getdoc(mod)
    for name in sorted(dir(mod)):
        if name.startswith("_"):
            continue
        obj = getattr(mod, name, None)
        if not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        yield inspect.getdoc(obj)
        if inspect.isclass(obj):
            for attr, member in sorted(vars(obj).items()):
                if attr.startswith("_"):
                    continue
                if isinstance(member, (classmethod, staticmethod)):
                    member = member.__func__
                if inspect.isroutine(member) or isinstance(member, property):
                    yield inspect.getdoc(member)


@functools.lru_cache(maxsize=4)
def build_corpus(min_bytes: int = 200_000) -> str:
    """Docstrings of :data:`CORPUS_MODULES` and their public members, repeated to ``min_bytes``.

    Duplicates (re-exported or inherited docstrings) are dropped so the text is not
    dominated by a few repeated paragraphs.
    """
    seen: set[str] = set()
    parts: list[str] = []
    with warnings.catch_warnings():
        # Touching deprecated aliases (e.g. typing.io) warns; that is not the caller's concern.
        warnings.simplefilter("ignore", DeprecationWarning)
        for module_name in CORPUS_MODULES:
            for doc in _docstrings(module_name):
                if doc and doc not in seen:
                    seen.add(doc)
                    parts.append(doc)
    text = "\n\n".join(parts) + "\n\n"
    n = len(text.encode("utf-8"))
    return text * max(1, -(-min_bytes // n))  # ceil division


class TokenDataset(Dataset):
    """Non-overlapping windows: sample i covers tokens[i*seq_len : i*seq_len + seq_len + 1].

    ``num_samples`` beyond the number of windows wraps around (another pass over the
    text), so long runs can ask for any number of samples.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, num_samples: int | None = None) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(f"need at least seq_len + 1 = {seq_len + 1} tokens, got {len(tokens)}")
        self.num_samples = self.num_windows if num_samples is None else num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.num_samples:
            raise IndexError(i)
        start = (i % self.num_windows) * self.seq_len
        w = self.tokens[start : start + self.seq_len + 1]
        # Labels are aligned here, once, on the whole sequence: a sequence-sharding
        # strategy can then split input_ids and labels identically.
        return {"input_ids": w[:-1], "labels": w[1:]}


class TextDataModule(L.LightningDataModule):
    """Byte-tokenized docstring corpus; the last ``val_samples`` windows are validation."""

    def __init__(
        self,
        seq_len: int = 128,
        batch_size: int = 4,
        num_samples: int | None = None,
        val_samples: int = 16,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if seq_len < 1 or batch_size < 1 or val_samples < 1:
            raise ValueError(
                f"seq_len={seq_len}, batch_size={batch_size} and val_samples={val_samples} must all be >= 1 "
                "(to skip validation, pass limit_val_batches=0 to the Trainer)"
            )
        self.save_hyperparameters()
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.num_samples = num_samples
        self.val_samples = val_samples
        self.num_workers = num_workers
        self.tokenizer = ByteTokenizer()
        self.train_dataset: TokenDataset | None = None
        self.val_dataset: TokenDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        val_len = self.val_samples * self.seq_len + 1
        # Room for the validation tail plus at least one training window.
        corpus = build_corpus(max(200_000, val_len + self.seq_len + 1))
        data = corpus.encode("utf-8")
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        split = len(tokens) - val_len
        self.train_dataset = TokenDataset(tokens[: split + 1], self.seq_len, self.num_samples)
        self.val_dataset = TokenDataset(tokens[split:], self.seq_len, self.val_samples)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.val_dataset, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers
        )

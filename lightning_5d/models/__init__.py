"""Reference model and data: an ordinary Llama-style LightningModule (GQA, RoPE, SwiGLU,
optional MoE) that every lightning_5d feature must scale without changes to its code."""

from lightning_5d.models.data import ByteTokenizer, TextDataModule, TokenDataset, build_corpus
from lightning_5d.models.llama import LlamaConfig, LlamaLM, LlamaModel

__all__ = ["LlamaConfig", "LlamaModel", "LlamaLM", "TextDataModule", "TokenDataset", "ByteTokenizer", "build_corpus"]

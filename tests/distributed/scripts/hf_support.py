"""Hugging Face causal LMs from small configs, each in the LightningModule a user would write.

No weights are downloaded: the models are built from configs with random init (seeded).
Vocabulary 256 matches the byte tokenizer of the shared TextDataModule.
"""

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

from tests_support import BATCH_SIZE, make_datamodule


def build_hf_model(name: str, layers: int = 2):
    import transformers as tf

    common = dict(vocab_size=256, tie_word_embeddings=False)
    if name == "llama":  # grouped-query attention: 8 query heads share 4 kv heads
        config = tf.LlamaConfig(**common, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)  # fmt: skip
        return tf.LlamaForCausalLM(config)
    if name == "qwen2":  # biases on q/k/v
        config = tf.Qwen2Config(**common, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)  # fmt: skip
        return tf.Qwen2ForCausalLM(config)
    if name == "gpt2":  # fused c_attn Conv1D, learned positions, tied head
        config = tf.GPT2Config(vocab_size=256, n_embd=64, n_layer=layers, n_head=4, n_positions=64,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        return tf.GPT2LMHeadModel(config)
    if name == "mixtral":  # grouped experts: [E, ...] weights called as experts(x, top_k_index, top_k_weights)
        config = tf.MixtralConfig(**common, hidden_size=64, intermediate_size=64, num_hidden_layers=layers,
                                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                                  num_local_experts=4, num_experts_per_tok=2)  # fmt: skip
        return tf.MixtralForCausalLM(config)
    if name == "qwen2_moe":  # grouped experts plus a sigmoid-gated shared expert
        config = tf.Qwen2MoeConfig(**common, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                                   num_experts=4, num_experts_per_tok=2, norm_topk_prob=False)  # fmt: skip
        return tf.Qwen2MoeForCausalLM(config)
    raise ValueError(name)


class CausalLM(L.LightningModule):
    """The obvious LightningModule around a Hugging Face model (plus a loss record)."""

    def __init__(self, name: str, layers: int = 2):
        super().__init__()
        self.model = build_hf_model(name, layers)
        self.losses = []

    def compute_loss(self, batch):
        if isinstance(self.model.config, __import__("transformers").GPT2Config):
            return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss  # HF's own loss
        logits = self.model(input_ids=batch["input_ids"]).logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), batch["labels"].view(-1))

    def training_step(self, batch, batch_idx):
        loss = self.compute_loss(batch)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.0)


def train_one_process(module, steps: int, data_ranks: int, batch_size: int = BATCH_SIZE) -> list[float]:
    """``steps`` of ``module.compute_loss`` on the global batches a run with ``data_ranks`` data
    ranks sees (the first epoch's order, seed 0); the loss of each."""
    dm = make_datamodule(batch_size=batch_size)
    dm.setup("fit")
    dataset = dm.train_dataset
    optimizer = module.configure_optimizers()
    global_batch = batch_size * data_ranks
    perm = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0)).tolist()
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        batch = default_collate([dataset[i] for i in perm[step * global_batch : (step + 1) * global_batch]])
        loss = module.compute_loss(batch)
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
    return losses


def hf_reference_run(name: str, steps: int, data_ranks: int, dtype=torch.float32, layers: int = 2,
                     batch_size: int = BATCH_SIZE, initial_state: dict | None = None):  # fmt: skip
    """One process, same init (or ``initial_state`` for the HF model) and the same global
    batches as the multi-process run."""
    L.seed_everything(0, verbose=False)
    module = CausalLM(name, layers).to(dtype)
    if initial_state is not None:
        module.model.load_state_dict(initial_state)
    losses = train_one_process(module, steps, data_ranks, batch_size)
    return losses, module.state_dict()

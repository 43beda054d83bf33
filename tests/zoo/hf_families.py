"""Hugging Face families beyond the layout matrix's Llama, Qwen2, GPT-2 and Mixtral, from tiny
configs with random init (nothing downloaded), each in the obvious LightningModule
(``model(input_ids=...).logits``). Dropouts are 0 so that every layout can match one process.

- GPT-NeoX: fused ``query_key_value`` laid out per head ([q_h|k_h|v_h] for each head h),
  rotary on a quarter of each head (``rotary_pct=0.25``), parallel residual.
- Phi-3: fused ``qkv_proj`` ([q|k|v], grouped-query) and fused ``gate_up_proj``
  (``chunk(2, -1)``); reads ``self.config.num_attention_heads`` at forward time.
- OLMo-2: q/k RMSNorm over the whole projection width (not per head), norms after the
  attention and MLP outputs (no pre-norm).
- Qwen3: q/k RMSNorm per head, grouped-query, an explicit ``head_dim``.
- Gemma: head dim 32 with hidden 64 and 4 heads (head_dim != hidden/heads), an embedding
  subclass that scales its output by sqrt(hidden), tied input/output embeddings, (1 + w) RMSNorm.
"""

from zoo.adapter import HuggingFace

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64)  # fmt: skip
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def gpt_neox():
    import transformers as tf

    config = tf.GPTNeoXConfig(**COMMON, rotary_pct=0.25, use_parallel_residual=True, attention_dropout=0.0,
                              hidden_dropout=0.0, tie_word_embeddings=False, **TOKENS)  # fmt: skip
    return HuggingFace(tf.GPTNeoXForCausalLM(config))


def phi3():
    import transformers as tf

    config = tf.Phi3Config(**COMMON, num_key_value_heads=2, original_max_position_embeddings=64, resid_pdrop=0.0,
                           embd_pdrop=0.0, attention_dropout=0.0, tie_word_embeddings=False, **TOKENS)  # fmt: skip
    return HuggingFace(tf.Phi3ForCausalLM(config))


def olmo2():
    import transformers as tf

    config = tf.Olmo2Config(**COMMON, num_key_value_heads=2, attention_dropout=0.0, tie_word_embeddings=False, **TOKENS)
    return HuggingFace(tf.Olmo2ForCausalLM(config))


def qwen3():
    import transformers as tf

    config = tf.Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=16, attention_dropout=0.0,
                            tie_word_embeddings=False, **TOKENS)  # fmt: skip
    return HuggingFace(tf.Qwen3ForCausalLM(config))


def gemma():
    import transformers as tf

    config = tf.GemmaConfig(**COMMON, num_key_value_heads=2, head_dim=32, attention_dropout=0.0,
                            tie_word_embeddings=True, **TOKENS)  # fmt: skip
    return HuggingFace(tf.GemmaForCausalLM(config))

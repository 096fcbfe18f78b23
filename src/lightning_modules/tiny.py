"""Tiny random models saved with ``save_pretrained``: base models for tests and smoke runs."""

from __future__ import annotations

from pathlib import Path

import torch

from ..data.tokenization import BYTE_VOCAB_SIZE

__all__ = ["save_tiny_llama"]


def save_tiny_llama(path: str | Path, *, vocab_size: int = BYTE_VOCAB_SIZE, hidden_size: int = 64,
                    num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                    intermediate_size: int = 128, seed: int = 0, tokenizer: bool = True) -> Path:
    """A random Llama (GQA by default) in ``path``, with the byte tokenizer when asked."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..data.recall_bytes import EOS_ID, PAD_ID, byte_tokenizer

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                      num_hidden_layers=num_layers, num_attention_heads=num_heads,
                      num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size,
                      max_position_embeddings=2048, pad_token_id=PAD_ID, eos_token_id=EOS_ID,
                      bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    path = Path(path)
    model.save_pretrained(path)
    if tokenizer:
        byte_tokenizer().save_pretrained(path)
    return path

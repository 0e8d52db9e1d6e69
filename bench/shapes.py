"""Model shapes the GPU benchmarks share, and random-weight model folders built from them."""

import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from arctic_core.demo.tiny_model import build_tokenizer

QWEN3_1_7B = dict(
    hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=True, rope_theta=1000000.0,
)

SMOKE_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=1024, tie_word_embeddings=True)


def make_model(folder: str, shape: dict, dtype: torch.dtype = torch.bfloat16) -> None:
    """Random weights (bf16 unless told) and a small byte-level tokenizer (token ids stay below its vocabulary)."""
    if os.path.exists(os.path.join(folder, "config.json")):
        return
    tokenizer = build_tokenizer([f"w{i} alpha{i % 37} beta{i % 91}" for i in range(3000)], vocab_size=1000)
    config = AutoConfig.for_model("qwen3", **shape, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # random init of 1.7 B is slow on the CPU
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def random_prompt_texts(tokenizer_folder: str, prompt_len: int, rows: int) -> list[str]:
    """``rows`` texts of about ``prompt_len`` tokens each, decoded from random token ids (seeded)."""
    import random

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    rng = random.Random(0)
    return [tokenizer.decode([rng.randrange(3, 999) for _ in range(prompt_len)]) for _ in range(rows)]

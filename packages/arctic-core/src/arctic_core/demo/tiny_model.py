"""A tiny random Qwen3-architecture policy and a byte-level BPE tokenizer, built in code.

No hub downloads exist on our machines, so tests and the demo make their models here. Any
architecture transformers knows can be built the same way (see ``build_tiny_model``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

PAD, BOS_TURN, EOS_TURN = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2}
TINY_SHAPES: dict[str, dict[str, object]] = {
    "qwen3": {**_SHAPE, "head_dim": 32},
    "qwen2": dict(_SHAPE),
    "llama": {**_SHAPE, "head_dim": 32},
    # A window shorter than the test sequences, so that sliding-window attention really matters.
    "mistral": {**_SHAPE, "head_dim": 32, "sliding_window": 5},
}
"""Tiny shapes per model family (GQA everywhere: 4 query heads over 2 KV heads)."""


def build_tokenizer(corpus: Iterable[str], vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``corpus`` and wrap it with Qwen-style chat special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS_TURN, EOS_TURN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS_TURN, chat_template=CHAT_TEMPLATE
    )


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    family: str = "qwen3",
    seed: int = 0,
    attn_implementation: str = "sdpa",
    **overrides: object,
) -> PreTrainedModel:
    """A randomly initialised causal LM of ``family`` sized for CPU tests (fp32)."""
    shape = {**TINY_SHAPES.get(family, _SHAPE), **overrides}
    config = AutoConfig.for_model(
        family,
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **shape,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn_implementation)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def save_tiny_policy(path: str | Path, corpus: Iterable[str], family: str = "qwen3", seed: int = 0,
                     **overrides: object) -> Path:
    """Build tokenizer + model and ``save_pretrained`` both into ``path`` (a loadable HF folder)."""
    path = Path(path)
    tokenizer = build_tokenizer(corpus)
    model = build_tiny_model(tokenizer, family=family, seed=seed, **overrides)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path

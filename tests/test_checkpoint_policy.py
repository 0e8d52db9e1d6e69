"""``checkpoint_layers: auto``: the activation estimate against measured figures, and the rule that
turns free memory into a number of checkpointed layers (the trainers' use: test_deepspeed_engine)."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from arctic_zorro.checkpoint_policy import kept_layer_bytes, layers_to_checkpoint

QWEN3_1_7B = dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8, head_dim=128)


@pytest.mark.parametrize(("tokens", "gib_per_kept_layer"), [(4096 + 8 * 512, 0.83), (16384 + 8 * 1024, 2.5)])
def test_the_kept_layer_estimate_covers_the_measured_activations(tokens, gib_per_kept_layer):
    # H200, bf16, bench/zorro_train.py --checkpoint-layers: each layer kept instead of checkpointed
    # raised the peak by 0.83 GiB at 4096/512/8 and 2.5 GiB at 16384/1024/8 (packed tokens above);
    # a kept layer holds its activations where a checkpointed one holds its input.
    config = AutoConfig.for_model("qwen3", **QWEN3_1_7B)
    measured = gib_per_kept_layer * 2**30 / tokens + config.hidden_size * 2
    assert 1.0 <= kept_layer_bytes(config, 2) / measured <= 1.25


def test_free_memory_buys_kept_layers_from_the_last_one_down():
    layers, tokens, kept, saved_input = 28, 1000, 100, 4
    need = lambda checkpointed: tokens * ((layers - checkpointed) * kept + checkpointed * saved_input + kept)  # noqa: E731
    assert layers_to_checkpoint(layers, tokens, kept, saved_input, budget=0) == layers
    assert layers_to_checkpoint(layers, tokens, kept, saved_input, budget=1 << 40) == 0
    for checkpointed in (27, 20, 8, 1):
        assert layers_to_checkpoint(layers, tokens, kept, saved_input, need(checkpointed)) == checkpointed
        assert layers_to_checkpoint(layers, tokens, kept, saved_input, need(checkpointed) - 1) == checkpointed + 1
    counts = [layers_to_checkpoint(layers, tokens, kept, saved_input, budget)
              for budget in range(0, need(0) + 1, 50_000)]
    assert counts == sorted(counts, reverse=True)  # more memory never checkpoints more

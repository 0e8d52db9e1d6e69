"""Model shapes the GPU benchmarks share (random weights are built from them in each script)."""

QWEN3_1_7B = dict(
    hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=True, rope_theta=1000000.0,
)

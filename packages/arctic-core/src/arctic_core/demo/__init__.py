"""The embedded demo: a tiny Qwen3 learns a verifiable task with GRPO through the client."""

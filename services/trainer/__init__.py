"""Trainer service: Megatron-Core GPT training core."""

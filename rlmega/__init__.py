"""rlmega: reinforcement-learning post-training of large language models on Megatron-Core."""

__version__ = "0.1.0"

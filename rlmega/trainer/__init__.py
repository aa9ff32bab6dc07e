"""The RL trainer: the loop that turns prompts into policy updates (see README.md)."""

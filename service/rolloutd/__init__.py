"""rolloutd: a rollout service for RL post-training of LLMs."""

__version__ = "0.1.0"

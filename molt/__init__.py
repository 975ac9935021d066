"""Molt: PyTorch-native agentic RL for LLMs."""

"""Molt: PyTorch-native agentic RL for LLMs."""

from molt.quiet import silence_import_noise

silence_import_noise()   # before any Molt module imports vLLM or AutoModel, in every process

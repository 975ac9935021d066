"""Agents as plain Python: an `Env` (the framework owns the LLM loop) or a `ChatAgent` (the user owns it
through the stock OpenAI / Anthropic SDK against a loopback server). A run's agent module exports
`AgentRunner`; `load_agent_runner` finds it."""

from molt.agents.env import Env, Result, State, StepEnvRunner
from molt.agents.loader import load_agent_runner

__all__ = ["Env", "Result", "State", "StepEnvRunner", "ChatAgent", "ChatAgentRunner", "ChatContext",
           "load_agent_runner"]


def __getattr__(name: str):
    # The chat path imports Starlette and vLLM's wire schemas; Env-only runs need neither.
    if name in ("ChatAgent", "ChatAgentRunner", "ChatContext"):
        from molt.agents import chat

        return getattr(chat, name)
    raise AttributeError(f"module 'molt.agents' has no attribute {name!r}")

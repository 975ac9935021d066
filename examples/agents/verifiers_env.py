"""Any Prime Intellect `verifiers` environment as a Molt ChatAgent, unmodified.

verifiers rolls an environment out through an OpenAI client and scores it with the environment's own
rubric; here that client points at the loopback server, so the loop, the tools and the reward are the
environment's and the trajectory is Molt's token-exact record. Options: `env` (an installed
environment id for `vf.load_environment`, or a .py file with `load_environment()`), `env_args` (its
keyword arguments), `sampling_args` (passed to the environment's requests, e.g. a forced `tool_choice`:
constrained decoding, for evaluation only; a training rollout with it fails).
The dataset row gives the prompt (`messages` / `prompt`) and the `answer` (the row's label).
Needs `pip install molt[verifiers]`.
"""

import functools
import importlib.util
import json
from pathlib import Path

import verifiers as vf
from openai import AsyncOpenAI
from verifiers.clients import OpenAIChatCompletionsClient

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Result


@functools.cache
def load(env: str, env_args: str) -> vf.Environment:
    """The environment, built once per process (rollouts share it, as verifiers' own runners do)."""
    args = json.loads(env_args)
    if not env.endswith(".py"):
        return vf.load_environment(env, **args)
    spec = importlib.util.spec_from_file_location(f"vf_env_{Path(env).stem}", env)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.load_environment(**args)


class VerifiersAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        env = load(self.options["env"], json.dumps(self.options.get("env_args", {}), sort_keys=True))
        client = OpenAIChatCompletionsClient(AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key,
                                                         max_retries=0, http_client=ctx.http_client))
        row = {"prompt": ctx.messages, "example_id": 0, "answer": "" if ctx.label is None else str(ctx.label)}
        out = await env.run_rollout(row, client, ctx.model_name, dict(self.options.get("sampling_args", {})))
        if out.get("error"):   # verifiers records a failed rollout instead of raising: not trainable
            raise RuntimeError(f"verifiers rollout failed: {out['error']}")
        return Result(reward=float(out["reward"]), info={k: float(v) for k, v in out["metrics"].items()})


AgentRunner = ChatAgentRunner(VerifiersAgent)

"""The `agent` section of the run spec: the agent module, its budgets and failures, and the judge."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from molt.spec.rollout import EngineSpec
from molt.spec.strict import Strict

TOOLS_KEY = "tools"   # a dataset row's tool schemas (RL prompts and SFT conversations alike)


def check_tools(tools: Any, where: str) -> list[dict[str, Any]]:
    """`tools` if it is a list of OpenAI function schemas with distinct names whose parameters are JSON
    Schema, else a ValueError naming `where` (agent.tools, or a dataset row). The shape of a tool list is
    the spec's (agent.tools is a key); the driver checks each row's `tools` with it before a run starts
    (molt.driver.compose), and the agents again (molt.agents.tools.offered_tools)."""
    if not isinstance(tools, list):
        raise ValueError(f"{where} must be a list of tool schemas, got {type(tools).__name__}")
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and isinstance(fn.get("parameters", {}), dict)):
            raise ValueError(f"{where}[{i}] is not an OpenAI function schema "
                             '{"type": "function", "function": {"name": ..., "parameters": {...}}}: '
                             f"{json.dumps(tool)[:200]}")
        names.append(fn["name"])
        schema_error = _schema_error(fn.get("parameters", {}))
        if schema_error:
            raise ValueError(f"{where}[{i}] ({fn['name']}): its parameters are not a valid JSON Schema: "
                             f"{schema_error}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{where} names the tool(s) {twice} more than once")
    return tools


def _schema_error(schema: dict[str, Any]) -> str | None:
    """jsonschema's first objection to `schema` (as the metaschema of its $schema, 2020-12 by default), or
    None: the template shows the model these parameters, and the tool parser reads calls against them."""
    from jsonschema import exceptions, validators

    try:
        validators.validator_for(schema, default=validators.Draft202012Validator).check_schema(schema)
    except exceptions.SchemaError as err:
        where = "/".join(map(str, err.absolute_path)) or "(top)"
        return f"at {where}: {err.message}"
    return None


class JudgeSpec(Strict):
    path: str | None = Field(
        None, description="judge model: a Hugging Face folder, or 'policy' (the starting policy); null: "
        "none. With url: the folder of the judge's tokenizer")
    url: str | None = Field(
        None, description="an OpenAI-compatible server that serves the judge (vLLM's, e.g. "
        "http://host:8000/v1) instead of engines of the run's own; its first model answers")
    temperature: float = Field(
        1.0, gt=0, description="verdict sharpness: sigmoid((logp(yes) - logp(no)) / temperature)")
    timeout_s: float = Field(30.0, gt=0, description="seconds one verdict request may take before it is "
                             "retried")
    retries: int = Field(2, ge=0, description="retries of a verdict request that timed out or failed, then "
                         "the rollout fails")
    max_concurrency: int = Field(64, ge=1, description="verdict requests in flight at once (more wait)")
    engine: EngineSpec = Field(default_factory=lambda: EngineSpec(kv_cache_gib=0.25, max_restarts=0),
                               description="the judge's own engine(s), placed like the policy's (molt/plan/"
                               "placement.py); a dead one is not restarted")

    @model_validator(mode="after")
    def _no_restarts(self) -> JudgeSpec:
        # Only the policy's engines have a fleet that restarts them (molt/driver/fleet.py); the judge's
        # dispatcher goes on with the live ones and fails the verdicts once none is left.
        if self.url and not self.path:
            raise ValueError(f"agent.judge.url={self.url} needs agent.judge.path: the folder of the judge's "
                             "tokenizer (or 'policy'), which renders the verdict prompt")
        if self.engine.max_restarts:
            raise ValueError(f"agent.judge.engine.max_restarts={self.engine.max_restarts}: judge engines are "
                             "not restarted (a dead one leaves the others to score, none left fails the "
                             "rollouts); set it to 0 or add judge engines (agent.judge.engine.num_engines)")
        return self

class AgentSpec(Strict):
    module: str = Field("examples/agents/repeat.py",
                        description="dotted module or .py file that exports AgentRunner: StepEnvRunner(an "
                        "Env; Molt runs the LLM loop) or ChatAgentRunner(a ChatAgent; it calls the "
                        "OpenAI/Anthropic SDK)")
    options: dict[str, Any] = Field(default_factory=dict, description="passed to the agent unchanged")
    tool_parser: str = Field("hermes", description="vLLM tool parser reading the policy's tool calls (chat "
                             "server and Env)")
    tools: list[dict[str, Any]] = Field(
        default_factory=list, description="tool schemas (OpenAI function format) an Env shows the model on "
        "every rollout, before the dataset row's own `tools`")
    judge: JudgeSpec = Field(default_factory=JudgeSpec, description="LLM-as-judge rewards (agents.judge)")
    max_turns: int = Field(1, ge=1, description="most LLM calls per rollout")
    max_total_tokens: int = Field(256, ge=2, description="most tokens per rollout: prompt, turns and "
                                  "observations")
    timeout_s: float = Field(60.0, gt=0, description="seconds before a rollout fails as timed out")
    on_failure: Literal["drop_group", "keep_group"] = Field(
        "drop_group", description="a failed rollout drops its whole group, or only itself")
    max_failure_rate: float = Field(0.5, ge=0, le=1, description="stop the run when more of a batch than "
                                    "this fails")
    workers: int = Field(0, ge=0, description="Ray actors that run the training and evaluation rollouts, "
                         "each with its own event loop, chat server and sandboxes "
                         "(molt.driver.agent_workers); 0 = in the driver's event loop (docs/agents.md, Agent "
                         "workers)")
    max_worker_restarts: int = Field(3, ge=0, description="agent workers restarted over the run after a "
                                     "death (their in-flight groups rerun whole); one more stops the run")

    @field_validator("tools")
    @classmethod
    def _function_schemas(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        check_tools(value, "agent.tools")
        return value

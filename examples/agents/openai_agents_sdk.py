"""An OpenAI Agents SDK agent, unmodified, over the Responses API (the SDK's default wire).

The agent answers with its `square` tool: the SDK sends the request, runs the call and, as
`tool_use_behavior="stop_on_first_tool"` says, takes the tool's output as the final output. With
`options.follow_up` the conversation goes on: a second `Runner.run` gets the first run's items (the
function call and its output) plus the follow-up question, as the SDK's multi-turn chats do. Reward 1
when the last final output contains the label.

Options: `tool_choice` (e.g. "square": a forced call, how a random-init policy is made to call a tool;
constrained decoding, so evaluation only: a training rollout with it fails),
`follow_up` (a second user turn), `stream` (the SDK's streamed run). A reply cut at max_tokens is an
`incomplete` response, which the SDK raises on; the agent ends the conversation there with reward 0, so
the cut reply trains like any other (finish reason `length`) instead of failing the rollout.
Needs `pip install molt[agents]`.
"""

from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from agents.exceptions import ModelBehaviorError
from openai import AsyncOpenAI

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Result

set_tracing_disabled(True)   # the SDK would otherwise export traces to OpenAI's servers


@function_tool
def square(x: int) -> int:
    """The square of an integer."""
    return x * x


class AgentsSDKAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        questions = [ctx.messages[-1]["content"], *([self.options["follow_up"]] if "follow_up" in self.options
                                                    else [])]
        history, calls = [], 0
        async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0,
                               http_client=ctx.http_client) as client:
            agent = Agent(name="squarer", instructions="Use the square tool.", tools=[square],
                          model=OpenAIResponsesModel(ctx.model_name, client),
                          model_settings=ModelSettings(tool_choice=self.options.get("tool_choice")),
                          tool_use_behavior="stop_on_first_tool")
            for question in questions:
                try:
                    result = await self.turn(agent, history + [{"role": "user", "content": question}])
                except ModelBehaviorError as err:
                    # A failed rollout would drop every long reply from the batch (a bias towards short
                    # ones); a cut reply is an answer that scores 0, and the server kept its tokens.
                    if "max_output_tokens" not in str(err):
                        raise
                    return Result(reward=0.0, info={"tool_calls": float(calls)})
                history = result.to_input_list()
                calls += sum(item.type == "tool_call_item" for item in result.new_items)
        return Result(reward=float(str(ctx.label) in str(result.final_output)),
                      info={"tool_calls": float(calls)})

    async def turn(self, agent: Agent, items: list):
        # One model call per run: the tool's output is the answer (stop_on_first_tool).
        if not self.options.get("stream"):
            return await Runner.run(agent, items, max_turns=1)
        result = Runner.run_streamed(agent, items, max_turns=1)
        async for _ in result.stream_events():
            pass
        return result


AgentRunner = ChatAgentRunner(AgentsSDKAgent)

"""A LangGraph tool-calling agent on `langchain-openai`'s ChatOpenAI, unmodified.

The graph is LangGraph's ReAct loop: a model node, a `ToolNode` running `add`, and `tools_condition`
routing between them until the model answers without a call (or agent.max_turns model calls). Reward 1
when the final answer contains the label. `options.tool_choice` (e.g. "add") forces the first call: a
random-init policy rarely writes tool-call markup by itself. A forced call is constrained decoding, so it
is for evaluation; a training rollout with it fails. Needs `pip install molt[agents]`.
"""

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Result


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class LangGraphAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        llm = ChatOpenAI(model=ctx.model_name, base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0,
                         http_async_client=ctx.http_client)
        forced = llm.bind_tools([add], tool_choice=self.options.get("tool_choice"))
        free = llm.bind_tools([add])

        async def model(state: MessagesState) -> dict:
            first = not any(m.type == "ai" for m in state["messages"])
            return {"messages": [await (forced if first else free).ainvoke(state["messages"])]}

        graph = StateGraph(MessagesState)
        graph.add_node("model", model)
        graph.add_node("tools", ToolNode([add]))
        graph.add_edge(START, "model")
        graph.add_conditional_edges("model", tools_condition)
        graph.add_edge("tools", "model")
        # Each model call and each tool step is one graph step: the budget is max_turns model calls.
        state = await graph.compile().ainvoke({"messages": ctx.messages},
                                              {"recursion_limit": 2 * ctx.max_turns})
        answer = state["messages"][-1]
        calls = sum(len(getattr(m, "tool_calls", None) or []) for m in state["messages"])
        return Result(reward=float(str(ctx.label) in str(answer.content)), info={"tool_calls": float(calls)})


AgentRunner = ChatAgentRunner(LangGraphAgent)

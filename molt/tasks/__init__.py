"""Reference tasks: ready-made agents with their own data, built on the agent API (molt.agents) the way a
user's agent module is, and named by `agent.module` like one.

    molt.tasks.reasoning_gym   any reasoning-gym task: prompts generated, answers scored offline
    molt.tasks.tool_use        tool-use tasks (one or several tool calls per answer) over reasoning-gym's
"""

"""A shaping reward for configs/grpo-tools.yaml: credit for a tool call that ran.

With tools, each completion reaches a reward function as the exchange: assistant turns (with
`tool_calls`) and the tools' results as `{"role": "tool", "name", "content"}` messages. A call
that failed (unknown tool, wrong arguments, a raise, a timeout) is answered with "{'error': ...}".
"""


def used_tool(completions, **kwargs):
    """1.0 when the exchange holds a tool result that is not an error, else 0.0."""
    return [1.0 if any(m.get("role") == "tool" and not str(m.get("content", "")).startswith("{'error'")
                       for m in c) else 0.0
            for c in completions]

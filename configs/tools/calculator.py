"""Tools for configs/grpo-tools.yaml: arithmetic the model cannot do in its head, done exactly.

Each tool is a plain function with type hints and a docstring: mudpuppy builds the schema the model
reads from them (the `Args:` section describes each argument), as transformers does for
`apply_chat_template(tools=...)`.
"""


def multiply(a: int, b: int) -> int:
    """Multiply two whole numbers exactly.

    Args:
        a: the first number
        b: the second number
    """
    return int(a) * int(b)


def add(a: int, b: int) -> int:
    """Add two whole numbers exactly.

    Args:
        a: the first number
        b: the second number
    """
    return int(a) + int(b)

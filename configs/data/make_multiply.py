"""Write configs/data/multiply_rl_{train,val}.jsonl: three-digit by two-digit products, for GRPO with a
`multiply` tool, and configs/data/add_sft_train.jsonl: worked exchanges with another tool, `add`
(question, call, result, answer), for the short SFT stage that shows SmolLM2-135M what a tool call
looks like (it never writes one on its own: 0 calls in 64 samples at temperature 1, with or
without the call spelled out in the question). GRPO then has to find the right tool for products
by itself: nothing it is trained to imitate ever calls `multiply`.

    python configs/data/make_multiply.py

A 135M model cannot multiply 347 by 29 in its head; with the `multiply` tool it only has to call
it and copy the result. Each row: the question as a chat prompt and the product in `answer` (what
the exact_match reward reads). Train and validation pairs never overlap. Seeded: the files are
reproducible.
"""

import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tools"))
from calculator import add, multiply  # noqa: E402
QUESTION = "What is {a} times {b}? Use the multiply tool, then reply with only the number."
SUM = "What is {a} plus {b}? Use the add tool, then reply with only the number."


def rows(pairs):
    return [{"prompt": [{"role": "user", "content": QUESTION.format(a=a, b=b)}], "answer": str(a * b)}
            for a, b in pairs]


def exchanges(pairs):
    """SFT rows with the `add` tool: the question, the call, the tool's answer, the final answer;
    `tools` holds add's schema, built as GRPO builds multiply's (from the function)."""
    from transformers.utils import get_json_schema

    schema = get_json_schema(add)
    out = []
    for a, b in pairs:
        call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
        out.append({"tools": [schema], "messages": [
            {"role": "user", "content": SUM.format(a=a, b=b)},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "add", "content": str(add(a, b))},
            {"role": "assistant", "content": str(add(a, b))}]})
    return out


def main():
    rng = random.Random(31)
    pairs = set()
    while len(pairs) < 420:
        pairs.add((rng.randint(101, 999), rng.randint(11, 99)))
    pairs = sorted(pairs)
    rng.shuffle(pairs)
    for name, part in (("train", pairs[:300]), ("val", pairs[300:360])):
        path = HERE / f"multiply_rl_{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows(part)))
        print(f"{path}: {len(part)} rows")
    path = HERE / "add_sft_train.jsonl"      # pairs of their own: neither GRPO's prompts nor held out
    path.write_text("".join(json.dumps(r) + "\n" for r in exchanges(pairs[360:])))
    print(f"{path}: {len(pairs) - 360} rows")


if __name__ == "__main__":
    main()

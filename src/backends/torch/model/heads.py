"""The model's own output head: what its forward applies to the decoder's output, read from that forward.

The loss and log-prob paths run the decoder once and the output head only on
the positions that carry a target, a chunk at a time. That is exact only if
the head is all the model's forward does after the decoder, and for several
families it is not (transformers 5.24):

    Gemma 2 / 3, VaultGemma, nanochat   logits = cap * tanh(logits / cap)   config.final_logit_softcapping
    Granite, GraniteMoE(-hybrid/shared) logits = logits / config.logits_scaling
    Cohere, Cohere 2                    logits = logits * self.logit_scale
    Falcon-H1                           logits = lm_head(h) * self.model.lm_head_multiplier
    HyperCLOVA X                        logits = lm_head(h) * config.logits_scaling

Rather than a list of family names, the causal LM class's `forward` is read
(its source, as an AST): the statement that calls the head and the ones that
rework its result before the loss block are recognised when each is a
multiply or divide by a constant of the model (an attribute path from
`self`: `self.config.logits_scaling`), `torch.tanh`, or an `if <constant>
is not None:` around those. The constants are then read from the model
itself. A forward that does anything else after the head (or feeds the head
something other than the decoder's last hidden state) is not reproduced:
`head_inputs` then runs the model's full forward, its logits kept only at the
loss positions (`logits_to_keep`), which is exact whatever the family does.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

# A step of the post-head program: ("mul" | "div", path or number), ("tanh", None), ("if", path, steps).
Step = tuple


@dataclass(frozen=True)
class OutputHead:
    """The head module and the model's post-head operations, with the constants read from the model."""

    module: nn.Module
    ops: tuple[tuple[str, float | None], ...] = ()

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits, as the model's forward defines them."""
        logits = self.module(hidden).float()
        for op, value in self.ops:
            if op == "mul":
                logits = logits * value
            elif op == "div":
                logits = logits / value
            else:
                logits = torch.tanh(logits)
        return logits

    def describe(self) -> str:
        words = {"mul": "* {}", "div": "/ {}", "tanh": "tanh"}
        return ", ".join(words[op].format(v) for op, v in self.ops) or "the head alone"


def output_head(model: nn.Module) -> OutputHead | None:
    """The model's own head (module and post-head operations), or None when its forward does something
    after the decoder that this module cannot reproduce (the caller then runs the full forward)."""
    module = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if module is None:
        return None
    name = next((n for n, child in model.named_children() if child is module), None)
    forward = getattr(type(model), "forward", None)
    if name is None or forward is None:
        return None
    program = post_head_program(inspect.unwrap(forward), name)
    if program is None:
        return None
    ops = resolve(program, model)
    return None if ops is None else OutputHead(module, tuple(ops))


@functools.lru_cache(maxsize=64)
def post_head_program(forward, head_name: str) -> tuple[Step, ...] | None:
    """The symbolic operations `forward` applies to `self.<head_name>(hidden_states)` before its loss, or
    None when they are not all of the recognised kinds. Cached per class (the source is the class's)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    func = tree.body[0]
    if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    hidden_ok, steps, var = False, [], None
    for stmt in func.body:
        if var is None:
            if calls_attr(stmt, head_name):
                var, first = head_statement(stmt, head_name, hidden_ok)
                if var is None:
                    return None
                steps.extend(first)
            elif assigns(stmt, "hidden_states"):
                if isinstance(stmt, ast.If) and not stmt.orelse:     # Gemma 4: slice unless already sliced
                    hidden_ok = hidden_ok and all(keeps_positions(s) for s in stmt.body)
                else:
                    hidden_ok = is_last_hidden_state(stmt) or (hidden_ok and keeps_positions(stmt))
            continue
        if isinstance(stmt, ast.Return) or mentions(stmt, ("labels", "loss")):
            return tuple(steps)
        if assigns(stmt, var):
            more = rework(stmt, var, {})
            if more is None:
                return None
            steps.extend(more)
        elif mentions(stmt, (var,)):
            return None            # read without reassignment: an in-place change (`logits.mul_(...)`) or unknown use
    return tuple(steps) if var is not None else None


def head_statement(stmt: ast.stmt, head_name: str, hidden_ok: bool) -> tuple[str | None, list[Step]]:
    """`logits = self.head(hidden_states[...])`, optionally `* constant` or `/ constant`."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return None, []
    var, value, steps = stmt.targets[0].id, stmt.value, []
    if isinstance(value, ast.BinOp) and isinstance(value.op, (ast.Mult, ast.Div)):
        operand = constant_path(value.right, {})
        if operand is None:
            return None, []
        steps.append(("mul" if isinstance(value.op, ast.Mult) else "div", operand))
        value = value.left
    if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "contiguous"
            and not value.args):
        value = value.func.value          # OPT: `self.lm_head(hidden_states).contiguous()`
    if not (isinstance(value, ast.Call) and is_self_attr(value.func, head_name) and len(value.args) == 1
            and not value.keywords and hidden_ok and reads_hidden_states(value.args[0])):
        return None, []
    return var, steps


def rework(stmt: ast.stmt, var: str, names: dict) -> list[Step] | None:
    """The steps of one statement that reassigns `var`, or None when it is not a recognised kind."""
    if isinstance(stmt, ast.If) and not stmt.orelse:
        test = stmt.test
        if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.IsNot)
                and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None):
            return None
        subject, names = test.left, dict(names)
        if isinstance(subject, ast.NamedExpr):
            path = constant_path(subject.value, names)
            if path is None:
                return None
            names[subject.target.id] = path
            subject = subject.target
        path = constant_path(subject, names)
        body = [rework(s, var, names) for s in stmt.body]
        if path is None or any(b is None for b in body):
            return None
        return [("if", path, tuple(step for b in body for step in b))]
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
            and stmt.targets[0].id == var):
        return None
    value = stmt.value
    is_var = lambda node: isinstance(node, ast.Name) and node.id == var   # noqa: E731
    if isinstance(value, ast.BinOp) and isinstance(value.op, (ast.Mult, ast.Div)):
        kind = "mul" if isinstance(value.op, ast.Mult) else "div"
        if is_var(value.left) and (path := constant_path(value.right, names)) is not None:
            return [(kind, path)]
        if kind == "mul" and is_var(value.right) and (path := constant_path(value.left, names)) is not None:
            return [(kind, path)]
        return None
    if isinstance(value, ast.Call) and len(value.args) == 1 and not value.keywords and is_var(value.args[0]):
        func = value.func
        if isinstance(func, ast.Attribute) and func.attr == "tanh" and isinstance(func.value, ast.Name) \
                and func.value.id == "torch":
            return [("tanh", None)]
    if isinstance(value, ast.Call) and not value.args and not value.keywords and isinstance(value.func, ast.Attribute) \
            and value.func.attr == "float" and is_var(value.func.value):
        return []          # the loss computes in float32 anyway
    return None


def constant_path(node: ast.expr, names: dict) -> tuple | float | None:
    """`self.a.b`, `self.config.get_text_config().c` (as a tuple of steps), a number, or a name bound to one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return float(node.value)
    if isinstance(node, ast.Name):
        return names.get(node.id)
    parts: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        elif (isinstance(node, ast.Call) and not node.args and not node.keywords
              and isinstance(node.func, ast.Attribute)):
            parts.append(node.func.attr + "()")
            node = node.func.value
        else:
            break
    if isinstance(node, ast.Name) and node.id == "self" and parts:
        return tuple(reversed(parts))
    return None


def resolve(program: tuple[Step, ...], model: nn.Module) -> list[tuple[str, float | None]] | None:
    """The program's operations with the model's constants filled in (None when one is not a number)."""
    ops: list[tuple[str, float | None]] = []
    for step in program:
        if step[0] == "tanh":
            ops.append(("tanh", None))
            continue
        value = read_path(model, step[1])
        if step[0] == "if":
            if value is not None:
                inner = resolve(step[2], model)
                if inner is None:
                    return None
                ops.extend(inner)
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = float(value)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return None
        ops.append((step[0], float(value)))
    return ops


def read_path(model: nn.Module, path):
    if isinstance(path, float):
        return path
    value = model
    for part in path:
        value = getattr(value, part[:-2])() if part.endswith("()") else getattr(value, part, None)
        if value is None:
            return None
    return value


# ------------------------------------------------------------------ AST helpers


def is_self_attr(node: ast.expr, name: str) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == name and isinstance(node.value, ast.Name) \
        and node.value.id == "self"


def calls_attr(stmt: ast.stmt, name: str) -> bool:
    return any(isinstance(n, ast.Call) and is_self_attr(n.func, name) for n in ast.walk(stmt))


def assigned_names(stmt: ast.stmt) -> set[str]:
    found = set()
    for node in ast.walk(stmt):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) else [])
        for t in targets:
            found |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    return found


def assigns(stmt: ast.stmt, name: str) -> bool:
    return name in assigned_names(stmt)


def mentions(stmt: ast.stmt, names: tuple[str, ...]) -> bool:
    return any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(stmt))


def is_last_hidden_state(stmt: ast.stmt) -> bool:
    """`hidden_states = outputs.last_hidden_state` or `outputs[0]`: the decoder's output as it is."""
    if not (isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None):
        return False
    value = stmt.value
    if isinstance(value, ast.Attribute):
        return value.attr == "last_hidden_state" and isinstance(value.value, ast.Name)
    return (isinstance(value, ast.Subscript) and isinstance(value.value, ast.Name)
            and isinstance(value.slice, ast.Constant) and value.slice.value == 0)


def keeps_positions(stmt: ast.stmt) -> bool:
    """`hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)`: a selection of positions."""
    value = getattr(stmt, "value", None)
    return (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
            and value.func.id == "slice_logits_to_keep" and bool(value.args)
            and isinstance(value.args[0], ast.Name) and value.args[0].id == "hidden_states")


def reads_hidden_states(node: ast.expr) -> bool:
    """`hidden_states` or `hidden_states[:, slice_indices, :]` (the positions kept)."""
    if isinstance(node, ast.Name):
        return node.id == "hidden_states"
    return isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "hidden_states"


# ------------------------------------------------------------------ the rows the head runs on


def head_inputs(model: nn.Module, body: Callable, inputs: dict, keep: torch.Tensor,
                record: dict | None = None) -> tuple[torch.Tensor, Callable]:
    """(rows [N, ...], head) such that head(rows[i:j]) are the model's own float32 logits at the positions
    `keep` selects (row-major), a chunk at a time.

    Where the head is reproduced, rows are the decoder's hidden states at those positions. Otherwise
    the model's full forward runs with its logits kept at the columns that hold a target (every
    causal LM of transformers 5 takes `logits_to_keep` as a tensor of positions), and the rows are
    those logits: exact for any family, at the cost of [B, columns, vocab] logits.

    `record`, when given, receives the forward's output under "outputs" (a mixture-of-experts model's
    router logits, asked for with ``output_router_logits`` in `inputs`)."""
    record = {} if record is None else record
    head = output_head(model)
    if head is not None:
        record["outputs"] = out = body(**inputs)
        return out.last_hidden_state[keep], head
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        columns = keep.any(dim=0).nonzero()[:, 0]
        record["outputs"] = out = model(**inputs, logits_to_keep=columns)
        return out.logits[keep[:, columns]], as_float
    record["outputs"] = out = model(**inputs)
    return out.logits[keep], as_float


def as_float(logits: torch.Tensor) -> torch.Tensor:
    return logits.float()

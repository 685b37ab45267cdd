"""`import mudpuppy` changes nothing global (issue 39): a program that imports it keeps its logging, its
environment, its warning filters and torch's settings as it had them. Each check runs in a fresh
interpreter, which imports torch and transformers first (so their own import-time setup is not counted),
snapshots that state, imports mudpuppy's modules and compares."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

SNAPSHOT = textwrap.dedent('''
    import json, logging, os, sys, warnings
    import torch, transformers, transformers.modeling_utils, peft

    def state():
        loggers = {name: logger for name, logger in logging.Logger.manager.loggerDict.items()
                   if isinstance(logger, logging.Logger)}
        loggers["<root>"] = logging.getLogger()
        return {
            "loggers": {name: [[repr(h) for h in lg.handlers], [type(f).__name__ for f in lg.filters],
                               lg.level, lg.propagate, lg.disabled] for name, lg in loggers.items()},
            "environ": dict(os.environ),
            "warnings": [repr(f) for f in warnings.filters],
            "torch": [torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
                      str(torch.get_default_dtype()), torch.is_grad_enabled(),
                      torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
                      torch.get_float32_matmul_precision()],
            "attention": sorted(transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS.keys()),
            "sdpa": repr(transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS["sdpa"]),
        }

    def changed(before, after):
        """What differs: a logger that did not exist before counts only if it has handlers or filters."""
        out = {}
        for key in before:
            if key == "loggers":
                diff = {n: v for n, v in after[key].items()
                        if before[key].get(n, [[], [], 0, True, False]) != v}
                if diff:
                    out[key] = diff
            elif key == "environ":
                diff = {k for k in before[key].keys() | after[key].keys() if before[key].get(k) != after[key].get(k)}
                if diff:
                    out[key] = sorted(diff)
            elif before[key] != after[key]:
                out[key] = [before[key], after[key]]
        return out

    before = state()
    for name in sys.argv[1:]:
        __import__(name)
    print(json.dumps(changed(before, state())))
''')

MODULES = [
    ["mudpuppy"],
    ["mudpuppy", "mudpuppy.cli"],
    # the torch backend's modules and what a run and the server import
    ["mudpuppy.backends.torch.backend", "mudpuppy.backends.torch.devices.cpu", "mudpuppy.training.sft",
     "mudpuppy.training.grpo", "mudpuppy.serving", "mudpuppy.monitor.trackers", "mudpuppy.export"],
]


@pytest.mark.parametrize("modules", MODULES, ids=["mudpuppy", "cli", "runtime"])
def test_importing_mudpuppy_leaves_the_process_as_it_was(modules):
    done = subprocess.run([sys.executable, "-c", SNAPSHOT, *modules], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {}


def test_the_snapshot_sees_a_logger_filter_added_at_import(tmp_path):
    """The check can fail: a module that adds a filter to another package's logger at import is seen."""
    (tmp_path / "noisy_module.py").write_text("import logging\nlogging.getLogger('torchao').addFilter(logging.Filter('x'))\n")
    done = subprocess.run([sys.executable, "-c", SNAPSHOT, "noisy_module"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torchao" in json.loads(done.stdout.strip().splitlines()[-1])["loggers"]


def test_torchaos_import_lines_are_dropped_only_while_held():
    import logging

    from mudpuppy.noise import import_noise_dropped

    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logger, handler = logging.getLogger("torchao"), Keep()
    logger.addHandler(handler)
    before = list(logger.filters)
    try:
        with import_noise_dropped():
            with import_noise_dropped():                  # nested holders leave each other's filters in place
                logger.warning("Failed to load /x/_C_mxfp8.so")
            logger.warning("Failed to load /x/_C_cutlass_90a.so")
            logger.warning("something else")
        assert logger.filters == before
        logger.warning("Failed to load after")
    finally:
        logger.removeHandler(handler)
    assert seen == ["something else", "Failed to load after"]

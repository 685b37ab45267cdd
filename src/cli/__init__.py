"""The `mudpuppy` command line: the click group and its verbs, one module a family of verbs.

    runs      run, train                      the training job, from a config or from flags
    checks    validate, preprocess            a config and its data, before anything trains
    measure   eval, score                     runs, adapters and models measured
    exports   export, merge, convert-adapter  a trained run as something else
    talk      chat, serve                     a model answering, in the terminal or over HTTP
    start     init, backends                  a first config; which runtimes work here
    parity    parity                          the same run on two runtimes, compared step by step
    webui     ui                              a web page over a folder of runs (src/ui)
    common    error handling and the options several verbs share
    tables    the before/after table a run ends with

User mistakes end in one message on stderr and exit code 2; `--debug` shows
the traceback. Anything else is a mudpuppy bug and keeps its traceback.
"""

from __future__ import annotations

import click

from ..noise import import_noise_dropped
from .checks import preprocess, validate
from .exports import convert_adapter, export, merge
from .measure import evaluate, score
from .parity import parity
from .runs import run, train
from .start import backends, init
from .talk import chat, serve
from .webui import ui

__all__ = ["main", "run", "train", "validate", "preprocess", "evaluate", "score", "export", "merge",
           "convert_adapter", "chat", "serve", "init", "backends", "parity", "ui"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mudpuppy")
def main():
    """Fine-tune language models on ROCm, CUDA, CPU or MLX from one YAML file."""
    _quiet_libraries()
    click.get_current_context().with_resource(import_noise_dropped())    # for the command, removed after it


def _quiet_libraries() -> None:
    """Keep the terminal to mudpuppy's own lines: no per-file loading bars, no library deprecation chatter.

    Must run before transformers / huggingface_hub are imported: they read these once.
    """
    import os
    import warnings

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers\..*")


for _verb in (run, train, init, validate, preprocess, merge, score, evaluate, export, chat, serve, backends,
              convert_adapter, parity, ui):
    main.add_command(_verb)

"""Talking to a model: `chat` in the terminal and `serve` over OpenAI's chat completions API, with the
options both share (which model, where it runs, how it samples)."""

from __future__ import annotations

import math
import os
import sys

import click

from .common import debug_option, handle_errors


class Finite(click.FloatRange):
    """A FloatRange that refuses nan and inf, which pass its comparisons (nan) or its bounds (inf without a
    max): a NaN temperature failed inside transformers with a traceback."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


def _talk_options(fn):
    """What `chat` and `serve` share: which model, where it runs, how it samples."""
    options = [
        click.argument("target", metavar="RUN_OR_MODEL"),
        click.option("--backend", "-b", default=None, help="auto, cpu, cuda, rocm or mlx (default: the run's, "
                                                           "else auto)."),
        click.option("--precision", type=click.Choice(["auto", "fp32", "bf16", "fp16"]), default="auto",
                     show_default=True, help="Compute precision; auto: the device's (bf16 autocast where native)."),
        click.option("--base-model", default=None, help="Base model for an adapter directory that does not name one."),
        click.option("--chat-template", default=None,
                     help="For adapters and models without a run config: a built-in template name or Jinja "
                          "(default: the tokenizer's own). A run always uses the template it trained with."),
        click.option("--trust-remote-code", is_flag=True,
                     help="Let Python files that came with the model run (auto_map); never taken from a run's "
                          "config.yaml."),
        click.option("--top-p", type=Finite(min=0, max=1, min_open=True), default=1.0, show_default=True,
                     help="Nucleus sampling: keep the most likely tokens up to this probability mass."),
        click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True,
                     help="Keep the K most likely tokens (0: no cut)."),
        click.option("--seed", type=click.IntRange(-2**63, 2**63 - 1), default=None,
                     help="Seed for sampling, a 64-bit integer (default: a fresh one per answer)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _load_talking_model(target, backend, precision, base_model, chat_template, trust_remote_code, name=None):
    from ..serving import load_chat_model

    click.echo(f"loading {target} ...", err=True)
    model = load_chat_model(target, backend, precision, base_model, chat_template, name, trust_remote_code)
    click.echo(f"backend: {model.backend.name} on {model.backend.device}; {model.description}", err=True)
    return model


@click.command()
@_talk_options
@click.option("--temperature", type=Finite(min=0), default=0.0, show_default=True,
              help="Sampling temperature; 0 (and anything below 1e-5) is greedy decoding (the answer "
                   "`mudpuppy eval` scores).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=512, show_default=True,
              help="Longest answer, in tokens.")
@click.option("--system", "system_prompt", default=None,
              help="System prompt (default: the run's data.datasets[0].system_prompt, if it set one).")
@click.option("--stats", is_flag=True, help="After each answer: prompt and answer tokens, time to first token, "
                                            "tokens/s (on stderr).")
@debug_option
@handle_errors
def chat(target, backend, precision, base_model, chat_template, trust_remote_code, top_p, top_k, seed, temperature,
         max_new_tokens, system_prompt, stats, debug):
    """Talk to a run, adapter or model in the terminal, the answer streamed as it is generated.

    RUN_OR_MODEL is a run directory, an adapter directory, a model directory, a .gguf file or a
    model alias. Each line is a message; /system TEXT, /reset, /save FILE.jsonl, /quit and /help
    are commands. From a pipe, each line is a message and only the answers go to stdout.
    """
    from ..serving import GenerationOptions
    from ..serving.chat import ChatSession, run_chat

    model = _load_talking_model(target, backend, precision, base_model, chat_template, trust_remote_code)
    options = GenerationOptions(max_new_tokens, temperature, top_p, top_k, seed)
    run_chat(ChatSession(model, options, system_prompt or model.system_prompt), stats=stats)


@click.command()
@_talk_options
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; 0.0.0.0 opens the server to the network (set --api-key then).")
@click.option("--port", type=click.IntRange(min=0, max=65535), default=8000, show_default=True,
              help="TCP port (0: a free one, printed at start).")
@click.option("--model-name", default=None, help="The model id clients send and /v1/models lists "
                                                  "(default: the directory name or alias).")
@click.option("--temperature", type=Finite(min=0, max=2), default=1.0, show_default=True,
              help="Temperature for requests that do not set one (OpenAI's default is 1); below 1e-5: greedy.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=512, show_default=True,
              help="max_tokens for requests that do not set one (cut to what the context leaves).")
@click.option("--max-tokens", "max_tokens_cap", type=click.IntRange(min=1), default=4096, show_default=True,
              help="The most tokens one request may ask for; above it, or above the context left after the "
                   "prompt, a request gets a 400.")
@click.option("--request-timeout", type=Finite(min=0), default=600.0, show_default=True,
              help="Seconds one answer may take from its arrival; then it ends with finish_reason "
                   "\"length\" (0: no limit).")
@click.option("--max-batch", type=click.IntRange(min=1), default=16, show_default=True,
              help="Answers decoded together in one batch; more requests wait for a place.")
@click.option("--max-body", type=Finite(min=0, min_open=True), default=4.0, show_default=True,
              metavar="MIB", help="The largest request body read, in MiB; a larger one gets a 413 before it is read.")
@click.option("--max-connections", type=click.IntRange(min=1), default=128, show_default=True,
              help="Connections handled at once; the next ones get a 503 with Retry-After.")
@click.option("--header-timeout", type=Finite(min=0, min_open=True), default=10.0, show_default=True,
              metavar="SECONDS", help="Seconds a request's line and headers may take to arrive; then a 408 and the "
                                      "connection closes (a slow client holds a connection this long at most).")
@click.option("--min-body-rate", type=Finite(min=0, min_open=True), default=64.0, show_default=True,
              metavar="KIB_S", help="A body must arrive within --header-timeout plus its size at this rate "
                                    "(KiB/s); then a 408.")
@click.option("--api-key", envvar="MUDPUPPY_API_KEY", default=None, show_envvar=True,
              help="Require 'Authorization: Bearer KEY' on every request (401 otherwise).")
@click.option("--allow-origin", "allow_origins", multiple=True, metavar="ORIGIN",
              help="A web origin (https://app.example) whose pages may call the server from a browser; "
                   "repeatable, * for any. Other origins get a 403.")
@debug_option
@handle_errors
def serve(target, backend, precision, base_model, chat_template, trust_remote_code, top_p, top_k, seed, host, port,
          model_name, temperature, max_new_tokens, max_tokens_cap, request_timeout, max_batch, max_body,
          max_connections, header_timeout, min_body_rate, api_key, allow_origins, debug):
    """Serve a run, adapter or model with OpenAI's chat completions API (docs/serve.md).

    POST /v1/chat/completions (stream: true for server-sent events) and GET /v1/models, on
    127.0.0.1:8000 unless --host/--port say otherwise. Concurrent requests are decoded
    together in one batch. Ctrl-C or SIGTERM ends the answers in progress and exits 0.
    """
    from ..serving import GenerationOptions
    from ..serving.server import ServerLimits, serve as serve_model, start_server

    if max_new_tokens > max_tokens_cap:
        raise click.BadParameter(f"{max_new_tokens} is above --max-tokens {max_tokens_cap}",
                                 param_hint="--max-new-tokens")
    defaults = GenerationOptions(max_new_tokens, temperature, top_p, top_k, seed)
    limits = ServerLimits(max_tokens_cap, request_timeout or None, max_batch, api_key or None, tuple(allow_origins),
                          max(1, int(max_body * 2**20)), max_connections, header_timeout, min_body_rate * 2**10)
    server = start_server(None, host, port, defaults, limits=limits)   # a port in use is reported before the load
    try:
        model = _load_talking_model(target, backend, precision, base_model, chat_template, trust_remote_code,
                                    model_name)
    except BaseException:
        server.server_close()
        raise
    serve_model(model, host, port, defaults, echo=click.echo, server=server)
    # Everything is closed and the decoding thread joined; what is left is the interpreter's teardown, where
    # torch's C++ thread pools can abort the process ("terminate called without an active exception", exit
    # 134) when a signal ended the run. Nothing is left to write, so leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

"""`mudpuppy chat`: a conversation in the terminal, the answer printed as it is generated.

Each line read is a user message, or one of the commands in HELP. At a terminal the
line is read with readline (history, editing) after a "> " prompt; from a pipe each
line is a message, the answers go to stdout one after another, and status lines go
to stderr, so `mudpuppy chat RUN < questions.txt > answers.txt` keeps only answers.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TextIO

from ..errors import MudpuppyError
from .bounds import ContextExceeded, PromptBound
from .engine import ChatModel, Completion, GenerationOptions

HELP = """commands:
  /system TEXT   set the system prompt (/system alone removes it); the conversation goes on
  /reset         forget the conversation (the system prompt stays)
  /save FILE     append the conversation to FILE (.jsonl) as a chat training record
  /quit          leave (Ctrl-D too)
  /help          this list"""


@dataclass
class ChatSession:
    model: ChatModel
    options: GenerationOptions
    system: str | None = None
    messages: list[dict] = field(default_factory=list)   # user and assistant turns, the system prompt apart
    answers: int = 0                                      # answers given: a fixed --seed steps by one each
    bound: PromptBound | None = None                      # serve's prompt bound, found at the first message

    def conversation(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages

    def reply(self, text: str, on_text=None) -> Completion:
        """Answer a user message; the exchange joins the conversation only when the answer is complete.
        ContextExceeded, before tokenizing when the text alone is too long, if the prompt does not fit."""
        turn = [*self.conversation(), {"role": "user", "content": text}]
        if self.bound is None:
            self.bound = PromptBound.of(self.model)
        prompt = self.bound.prompt_ids(self.model, turn)
        options = self.options
        if options.seed is not None:
            options = replace(options, seed=options.seed + self.answers)
        if self.bound.context is not None:      # an answer ends where the context does, as serve cuts max_tokens
            options = replace(options, max_new_tokens=min(options.max_new_tokens, self.bound.context - len(prompt)))
        completion = self.model.complete(turn, options, on_text, prompt)
        self.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": completion.text}]
        self.answers += 1
        return completion

    def save(self, file: str) -> str:
        """Append the conversation as one JSON line {"messages": [...]}: the chat format training reads."""
        path = Path(file).expanduser()
        if path.suffix.lower() != ".jsonl":
            return f"/save {file}: records are written as JSON lines; name a .jsonl file"
        if not any(m["role"] == "assistant" for m in self.messages):
            return "/save: nothing to save yet (no answer in this conversation)"
        if path.is_dir():
            return f"/save {file}: is a directory; name a .jsonl file"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            needs_newline = path.is_file() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
            with path.open("a", encoding="utf-8") as out:
                if needs_newline:
                    out.write("\n")
                out.write(json.dumps({"messages": self.conversation()}, ensure_ascii=False) + "\n")
        except OSError as exc:
            return f"/save {file}: {exc.strerror or exc}"
        turns = sum(m["role"] == "assistant" for m in self.messages)
        return f"saved {turns} answer{'s' if turns != 1 else ''} to {path}"

    def command(self, line: str) -> str | None:
        """Run a slash command; returns what to tell the user, or None to quit."""
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        if name in ("/quit", "/exit", "/q"):
            return None
        if name == "/system":
            self.system = arg or None
            return f"system prompt: {arg}" if arg else "system prompt removed"
        if name == "/reset":
            self.messages, self.answers = [], 0
            return "conversation cleared"
        if name == "/save":
            return self.save(arg) if arg else "/save needs a file name: /save FILE.jsonl"
        if name == "/help":
            return HELP
        return f"unknown command {name}\n{HELP}"


def run_chat(session: ChatSession, stdin: TextIO | None = None, stdout: TextIO | None = None,
             stderr: TextIO | None = None, interactive: bool | None = None, stats: bool = False) -> None:
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    if interactive is None:
        interactive = stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        say(stderr, f"chatting with {session.model.name} ({session.model.description}); /help for commands")
        if session.system:
            say(stderr, f"system prompt: {session.system}")
    for line in read_lines(stdin, stdout, stderr, interactive):
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            message = session.command(text)
            if message is None:
                return
            say(stderr, message)
            continue
        completion = answer(session, text, stdout, stderr, interactive)
        if completion is not None and stats:
            say(stderr, stats_line(completion))


def answer(session: ChatSession, text: str, stdout: TextIO, stderr: TextIO, interactive: bool) -> Completion | None:
    def show(piece: str) -> None:
        stdout.write(piece)
        stdout.flush()

    try:
        completion = session.reply(text, show)
    except ContextExceeded as exc:
        if not interactive:        # answering the lines after it would pair answers with the wrong lines
            raise MudpuppyError(f"a message read from stdin is too long: {exc} The chat stops here.") from None
        say(stderr, f"{exc} That message is left out; shorten it, or /reset to start a new conversation.")
        return None
    except KeyboardInterrupt:
        if not interactive:
            raise
        stdout.write("\n")
        say(stderr, "(interrupted; that exchange is left out of the conversation)")
        return None
    stdout.write("\n")
    stdout.flush()
    return completion


def read_lines(stdin: TextIO, stdout: TextIO, stderr: TextIO, interactive: bool):
    if not interactive:
        yield from utf8_lines(stdin)
        return
    while True:
        try:
            line = input("> ") if stdin is sys.stdin else prompt_and_read(stdin, stdout)
            bad = escaped_byte(line)
            if bad is None:
                yield line
            else:
                say(stderr, f"that line is not UTF-8 text ({bad}); type it again")
        except UnicodeDecodeError as exc:
            say(stderr, f"that line is not UTF-8 text ({not_utf8(exc)}); type it again")
        except EOFError:
            stdout.write("\n")
            return
        except KeyboardInterrupt:
            stdout.write("\n")
            return


def utf8_lines(stdin: TextIO):
    """A pipe's lines decoded as UTF-8 whatever the locale says; a line that is not UTF-8 ends the chat
    with a message naming it (answering the lines after it would pair answers with the wrong lines)."""
    raw = getattr(stdin, "buffer", None)
    if raw is None:                  # already text (a StringIO)
        yield from stdin
        return
    for number, line in enumerate(raw, 1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise MudpuppyError(f"stdin line {number}: not UTF-8 text ({not_utf8(exc)}); chat reads its messages "
                                "as UTF-8: convert the input first (iconv -f LATIN1 -t UTF-8, for one)") from None
        yield text.removeprefix("\ufeff") if number == 1 else text


def escaped_byte(line: str) -> str | None:
    """The first byte of a terminal's line that was not UTF-8: Python's stdin hands such bytes over as lone
    surrogates (surrogateescape, its choice under a C or UTF-8 locale), which no tokenizer can take."""
    for i, ch in enumerate(line):
        if "\udc80" <= ch <= "\udcff":
            at = len(line[:i].encode("utf-8", "surrogateescape")) + 1
            return f"byte 0x{ord(ch) - 0xdc00:02x} at byte {at} of the line"
    return None


def not_utf8(exc: UnicodeDecodeError) -> str:
    return f"byte 0x{exc.object[exc.start]:02x} at byte {exc.start + 1} of the line"


def prompt_and_read(stdin: TextIO, stdout: TextIO) -> str:
    stdout.write("> ")
    stdout.flush()
    line = stdin.readline()
    if not line:
        raise EOFError
    return line


def stats_line(c: Completion) -> str:
    rate = c.decode_rate()
    wait = c.seconds_to_first_token
    first = f"first token after {wait:.2f} s" if wait is not None else "no token"
    speed = f", {rate:.1f} tokens/s after it" if rate is not None else ""
    return f"[{c.prompt_tokens} prompt tokens, {c.completion_tokens} generated, {first}{speed}; {c.finish_reason}]"


def say(stream: TextIO, message: str) -> None:
    stream.write(message + "\n")
    stream.flush()

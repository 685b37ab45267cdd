"""Continuous batching for `mudpuppy serve`: one thread owns the model, every request decodes in its batch.

Request threads `submit` a Ticket and read its events; the scheduler thread admits waiting
tickets between steps (prefilling each alone), decodes one token for every active ticket per
step through the backend's `Decoder` (backends/protocol.py), and hands each token to its
ticket's queue. A ticket ends, and leaves the batch before the next step, at its stop token,
at max_tokens, at its deadline (--request-timeout), when its request cancels it (a stop
string, a client gone), when its own token cannot be drawn (the decoder's `failures`: that
request alone gets the error, the rest of the batch goes on) or when the server stops. So a long answer never holds the model: a
new request joins the batch at the next step.

Only this thread runs the model, and `stop` joins it: at exit no thread is inside torch (a
thread killed inside torch's thread pool aborts the process: "terminate called without an
active exception").

The request side (`generate`) turns tokens into text through engine.Answer (stop strings), watches the
client, and returns the Completion chat's engine returns for one request.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..backends.protocol import Sampling
from .engine import Answer, Completion, answer_seed

POLL = 0.05        # seconds between checks of a client while its tokens are awaited


class Stopping(Exception):
    """The server is shutting down and takes no new work."""


@dataclass(eq=False)
class Ticket:
    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling | None
    seed: int
    deadline: float | None                  # time.monotonic() after which the answer ends
    events: queue.Queue = field(default_factory=queue.Queue)   # ("token", id), then ("end", reason)
    cancelled: str | None = None            # why the request gave up on it
    generated: int = 0

    def cancel(self, why: str) -> None:
        self.cancelled = why


class Scheduler:
    def __init__(self, model, max_batch: int = 16, log: Callable[[str], None] | None = None):
        self.model = model
        self.max_batch = max_batch
        self.log = log or (lambda line: None)
        self.stop_ids = set(model.stop_ids)
        self.waiting: deque[Ticket] = deque()
        self.active: dict[int, Ticket] = {}      # decoder slot -> ticket
        self.wake = threading.Condition()
        self.stopping = False
        self.counts = {"finished": 0, "cancelled": 0, "timed_out": 0, "failed": 0}
        self.decoder = model.backend.open_decoder(model.handle)
        self.thread = threading.Thread(target=self.run, name="mudpuppy-decoder", daemon=True)
        self.thread.start()

    # ----------------------------------------------------------------- requests
    def submit(self, ticket: Ticket) -> None:
        with self.wake:
            if self.stopping:
                raise Stopping
            self.waiting.append(ticket)
            self.wake.notify()

    def stop(self) -> None:
        """End every answer ("shutdown"), then wait for the thread: the model is idle when this returns."""
        with self.wake:
            self.stopping = True
            self.wake.notify()
        if self.thread is not threading.current_thread():
            self.thread.join()

    def batch_sizes(self) -> dict[int, int]:
        return self.decoder.batch_sizes()

    # ----------------------------------------------------------------- the loop
    def run(self) -> None:
        try:
            while True:
                with self.wake:
                    while not (self.stopping or self.waiting or self.active):
                        self.wake.wait()
                    if self.stopping:
                        return
                    room = self.max_batch - len(self.active)
                    admitted = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
                for ticket in admitted:
                    if self.stopping:
                        self.end(None, ticket, "shutdown")
                    else:
                        self.admit(ticket)
                self.sweep()
                if self.active and not self.stopping:
                    self.step()
        finally:
            with self.wake:
                self.stopping = True
                left = list(self.waiting)
                self.waiting.clear()
            for ticket in left:
                self.end(None, ticket, "shutdown")
            for slot, ticket in list(self.active.items()):
                self.end(slot, ticket, "shutdown")
            self.decoder.close()

    def admit(self, ticket: Ticket) -> None:
        if self.expired(ticket):
            return self.end(None, ticket, "timeout")
        try:
            slot = self.decoder.add(ticket.prompt, ticket.sampling, ticket.seed)
        except Exception as exc:
            self.log(traceback.format_exc())
            return self.end(None, ticket, f"error: {type(exc).__name__}: {exc}")
        self.active[slot] = ticket

    def sweep(self) -> None:
        """Tickets their requests gave up on, and those past their deadline, leave the batch."""
        for slot, ticket in list(self.active.items()):
            if ticket.cancelled:
                self.end(slot, ticket, "cancelled")
            elif self.expired(ticket):
                self.end(slot, ticket, "timeout")

    def step(self) -> None:
        try:
            tokens = self.decoder.step()
        except Exception as exc:     # the forward pass failed: the batch is lost, its requests get the error
            self.log(traceback.format_exc())
            for slot, ticket in list(self.active.items()):
                self.end(slot, ticket, f"error: {type(exc).__name__}: {exc}")
            return
        for slot, exc in self.decoder.failures().items():   # one sequence's draw failed: it alone ends
            ticket = self.active.get(slot)
            if ticket is not None:
                self.log(f"an answer failed after {ticket.generated} tokens: {type(exc).__name__}: {exc}")
                self.end(slot, ticket, f"error: {type(exc).__name__}: {exc}")
        for slot, token in tokens.items():
            ticket = self.active[slot]
            ticket.generated += 1
            ticket.events.put(("token", token))
            if token in self.stop_ids:
                self.end(slot, ticket, "stop")
            elif ticket.generated >= ticket.max_new_tokens:
                self.end(slot, ticket, "length")

    def end(self, slot: int | None, ticket: Ticket, reason: str) -> None:
        if slot is not None:
            self.active.pop(slot, None)
            self.decoder.remove(slot)
        key = {"cancelled": "cancelled", "timeout": "timed_out"}.get(reason, "failed" if reason.startswith("error")
                                                                     else "finished")
        self.counts[key] += 1
        if reason == "timeout":
            self.log(f"request timed out after {ticket.generated} tokens")
        elif reason == "cancelled":
            self.log(f"generation stopped after {ticket.generated} tokens: {ticket.cancelled}")
        ticket.events.put(("end", reason))

    @staticmethod
    def expired(ticket: Ticket) -> bool:
        return ticket.deadline is not None and time.monotonic() > ticket.deadline


# --------------------------------------------------------------------------- the request side

class GenerationFailed(Exception):
    pass


def generate(scheduler: Scheduler, prompt: list[int], options, timeout: float | None,
             on_text: Callable[[str], None] | None = None, client_gone: Callable[[], bool] | None = None) -> Completion:
    """One answer through the scheduler: what `ChatModel.complete` returns for one request.

    finish_reason is "stop" (stop token, stop string) or "length" (max_tokens, the time limit,
    the server stopping). Raises ClientGone when `client_gone` says the client left (the
    answer stops being generated), GenerationFailed when the model failed, Stopping when the
    server takes no more work."""
    deadline = time.monotonic() + timeout if timeout else None
    ticket = Ticket(prompt, options.max_new_tokens, options.sampling(), answer_seed(options), deadline)
    answer = Answer(scheduler.model.tokenizer, scheduler.stop_ids, options.stop, on_text)
    scheduler.submit(ticket)
    checked = time.monotonic()
    while True:
        try:
            kind, value = ticket.events.get(timeout=POLL)
        except queue.Empty:
            kind = None
        if client_gone is not None and time.monotonic() - checked >= POLL:
            checked = time.monotonic()
            if client_gone():
                ticket.cancel("the client left")
                raise ClientGone
        if kind is None:
            continue
        if kind == "end":       # max_tokens, the time limit, shutdown ("length"), or a failure
            if value.startswith("error"):
                raise GenerationFailed(value.removeprefix("error: "))
            break
        try:
            more = answer.add(value)
        except BaseException:
            ticket.cancel("the answer could not be sent")
            raise
        if not more:            # its stop token (the scheduler ends the ticket itself) or a stop string
            if answer.stream.stopped:
                ticket.cancel("stop string")
            break
    return answer.finish(len(prompt))


class ClientGone(Exception):
    pass

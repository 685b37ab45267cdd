"""What every runtime's continuous-batching `Decoder` (protocol.py) shares: slots, the step loop,
the batch-size counts and the rows of a batch that sequences join and leave. No runtime here: backends/torch/generation/batch_decode.py and backends/mlx/batch_decode.py
supply how a prompt is prefilled, how the sequences' last tokens go through the model, and how one
token is drawn.
"""

from __future__ import annotations

from collections import Counter


class SlotDecoder:
    """A runtime's decoder subclasses this with

        prefill(prompt, sampling, seed) -> sequence   the prompt through the model: an object with
                                                      `token` and `logits` attributes
        feed()                                        every sequence's last drawn token through the model,
                                                      its next logits into `seq.logits`
        draw(seq) -> int                              one token from `seq.logits`; raises when they are not
                                                      numbers to draw from (that sequence alone then ends)

    and `model`, the module whose training mode `close` puts back."""

    def __init__(self, model):
        self.model = model
        self.training = model.training
        model.eval()
        self.seqs: dict = {}               # slot -> the runtime's sequence
        self.next_slot = 0
        self.sizes: Counter = Counter()    # batch size -> steps decoded at that size
        self.failed: dict = {}             # slot -> the error its draw raised (failures() hands them out)

    def add(self, prompt: list[int], sampling, seed: int) -> int:
        if not prompt:
            raise ValueError("a sequence needs a prompt of at least one token")
        slot, self.next_slot = self.next_slot, self.next_slot + 1
        self.seqs[slot] = self.prefill(prompt, sampling, seed)
        return slot

    def step(self) -> dict[int, int]:
        self.feed()
        out = {}
        for slot, seq in list(self.seqs.items()):
            try:
                token = self.draw(seq)
            except Exception as exc:     # this sequence's numbers broke (NaN logits, a warper's error): it alone ends
                self.failed[slot] = exc
                self.remove(slot)
                continue
            seq.token, seq.logits = token, None
            out[slot] = token
        if out:
            self.sizes[len(out)] += 1
        return out

    def failures(self) -> dict[int, Exception]:
        """The sequences whose token could not be drawn since the last call, {slot: the error}: each is
        removed already and left out of `step`'s answer; the others go on."""
        failed, self.failed = self.failed, {}
        return failed

    def remove(self, slot: int) -> None:
        self.seqs.pop(slot, None)

    def batch_sizes(self) -> dict[int, int]:
        return dict(self.sizes)

    def close(self) -> None:
        self.seqs.clear()
        self.failed.clear()
        self.model.train(self.training)


class BatchRows:
    """A batching decoder's rows, written once: a sequence is prefilled alone, in a cache of its own; once
    its first token is drawn it joins the batch as a row (`rows[r]` is row r's slot), and leaving drops its
    row. Mixed in before a runtime's SlotDecoder subclass, which supplies, besides prefill, feed and draw,

        join(slots)       those sequences' own caches into the batch, each `seq.cache` then None and its
                          slot appended to `rows`
        keep_rows(keep)   the batch cut to the rows listed (indices into `rows` as it was before a removal)
        drop_batch()      the batch emptied: no rows are left"""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rows: list[int] = []

    def step(self) -> dict[int, int]:
        out = super().step()
        self.join([slot for slot, seq in self.seqs.items() if seq.cache is not None])
        return out

    def remove(self, slot: int) -> None:
        seq = self.seqs.pop(slot, None)
        if seq is None or seq.cache is not None:   # unknown, or not in the batch yet
            return
        row = self.rows.index(slot)
        keep = [r for r in range(len(self.rows)) if r != row]
        self.rows.pop(row)
        if self.rows:
            self.keep_rows(keep)
        else:
            self.drop_batch()

    def close(self) -> None:
        self.rows = []
        self.drop_batch()
        super().close()


class NotFinite(ValueError):
    """A sequence's scores hold NaN or +infinity, or nothing is left to draw from: its answer cannot go on.
    Raised by a runtime's `draw` before its argmax or multinomial, which would pick garbage (argmax over
    NaN), fail with a message about probabilities, or on CUDA stop the device with an assert."""

    def __init__(self):
        super().__init__("the next token's scores are not finite numbers (NaN or infinity)")


def context_length(handle) -> int | None:
    """Tokens the model can attend over: its config's max_position_embeddings and the tokenizer's
    model_max_length, the smaller of those that are set and plausible (tokenizers without one say 1e30)."""
    model = handle.model
    configs = [getattr(model, "config", None), getattr(model, "args", None)]
    configs += [getattr(c, "text_config", None) for c in configs if c is not None]
    found = [getattr(c, "max_position_embeddings", None) for c in configs if c is not None]
    found.append(getattr(handle.tokenizer, "model_max_length", None))
    sane = [n for n in found if isinstance(n, int) and not isinstance(n, bool) and 0 < n <= 10**7]
    return min(sane) if sane else None

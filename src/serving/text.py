"""Token ids to text while they are generated.

A token is not always a whole character (byte-level BPE splits UTF-8), and a
stop string can arrive in pieces. So the whole answer is decoded again at
each token and only the part that is final goes out: nothing ending in a
half character (U+FFFD), nothing that could still grow into a stop string.
Decoding everything each time costs O(n^2) characters over an answer,
which is small next to a forward pass, and the pieces sent always add up to
`decode(ids)` cut at the first stop string.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] | list[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text = ""          # the answer so far, cut at a stop string once one appears
        self.sent = 0           # characters of `text` handed out
        self.stopped = False    # a stop string appeared: the answer is complete

    def add(self, token: int) -> str:
        """Take one generated id; return the text that became final with it ('' if none)."""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = self.first_stop(text)
        if cut is not None:
            self.text, self.stopped = text[:cut], True
            return self.flush()
        self.text = text
        end = len(text.rstrip(REPLACEMENT)) if text.endswith(REPLACEMENT) else len(text)
        end -= self.held_back(text[:end])
        return self.take(end)

    def flush(self) -> str:
        """Everything not yet handed out: at the end of the answer."""
        return self.take(len(self.text))

    def take(self, end: int) -> str:
        if end <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent:end], end
        return piece

    def first_stop(self, text: str) -> int | None:
        found = [i for i in (text.find(s, max(0, self.sent - len(s))) for s in self.stop) if i >= 0]
        return max(min(found), self.sent) if found else None

    def held_back(self, text: str) -> int:
        """Length of the longest end of `text` that is the start of a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest

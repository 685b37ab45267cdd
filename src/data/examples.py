"""Tokenized examples, one type per kind of training signal. numpy arrays only.

Every type is built from `Example`s, so length limits, statistics, caching
and decoded previews treat them all alike through `sequences()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np


@dataclass
class Example:
    """One token sequence; `loss_mask` marks the tokens the model is trained to predict."""

    input_ids: np.ndarray      # int32 [T]
    loss_mask: np.ndarray      # bool  [T]; True where the token is a training target
    source: str = ""           # file:line, for reports

    def __len__(self) -> int:
        return len(self.input_ids)

    def sequences(self) -> list[Example]:
        return [self]

    def truncated(self, max_len: int) -> Example:
        return Example(self.input_ids[:max_len], self.loss_mask[:max_len], self.source)

    def has_target(self) -> bool:
        # Token 0 is never a target: nothing comes before it.
        return bool(self.loss_mask[1:].any())


@dataclass
class ImageExample(Example):
    """A vision-language chat example: its ids hold each image's token run, and `images` the files
    whose pixels fill them (in order). A cut before `image_end` would split an image's tokens from
    its pixels, so such an example is dropped rather than truncated (prepare.fit_length)."""

    images: tuple[str, ...] = ()
    image_end: int = 0         # tokens [0, image_end) hold every image token

    def truncated(self, max_len: int) -> ImageExample:
        return replace(self, input_ids=self.input_ids[:max_len], loss_mask=self.loss_mask[:max_len])


@dataclass
class PairExample:
    """Preference data (DPO, IPO, SimPO, ORPO, pairwise reward): one prompt, two responses.

    Both sequences start with the same prompt tokens; each mask marks its response.
    """

    chosen: Example
    rejected: Example
    source: str = ""

    def __len__(self) -> int:
        return max(len(self.chosen), len(self.rejected))

    def sequences(self) -> list[Example]:
        return [self.chosen, self.rejected]

    def truncated(self, max_len: int) -> PairExample:
        return PairExample(self.chosen.truncated(max_len), self.rejected.truncated(max_len), self.source)

    def has_target(self) -> bool:
        return self.chosen.has_target() and self.rejected.has_target()


@dataclass
class LabeledExample:
    """A sequence with a label: KTO (bool, desirable or not) or reward (float score).

    For reward data the mask marks the last token, where the score is read.
    """

    example: Example
    label: float | bool
    source: str = ""

    def __len__(self) -> int:
        return len(self.example)

    def sequences(self) -> list[Example]:
        return [self.example]

    def truncated(self, max_len: int) -> LabeledExample:
        return replace(self, example=self.example.truncated(max_len))

    def has_target(self) -> bool:
        return bool(self.example.loss_mask.any())


@dataclass
class StepExample:
    """Process reward data: the mask marks the token that ends each step, in order."""

    example: Example
    step_labels: np.ndarray    # bool [steps], one per marked token
    source: str = ""

    def __len__(self) -> int:
        return len(self.example)

    def sequences(self) -> list[Example]:
        return [self.example]

    def truncated(self, max_len: int) -> StepExample:
        ex = self.example.truncated(max_len)
        return StepExample(ex, self.step_labels[: int(ex.loss_mask.sum())], self.source)

    def has_target(self) -> bool:
        return bool(self.example.loss_mask.any())


@dataclass
class PromptExample:
    """An RL prompt, ending where the answer begins; `fields` go to the reward functions."""

    prompt: Example
    fields: dict = field(default_factory=dict)
    source: str = ""

    def __len__(self) -> int:
        return len(self.prompt)

    def sequences(self) -> list[Example]:
        return [self.prompt]

    def truncated(self, max_len: int) -> PromptExample:
        # Keep the end: it holds the question and the generation prompt.
        p = self.prompt
        return replace(self, prompt=Example(p.input_ids[-max_len:], p.loss_mask[-max_len:], p.source))

    def has_target(self) -> bool:
        return len(self.prompt) > 0


AnyExample = Example | ImageExample | PairExample | LabeledExample | StepExample | PromptExample

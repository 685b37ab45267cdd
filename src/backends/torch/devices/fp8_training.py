"""fp8 training (`training.precision: fp8`, on a GPU whose plan says it has fp8 matmuls): the model's linear
layers swapped for torchao's float8 training layers. gpu.py decides whether a GPU can; this does the swap."""

from __future__ import annotations

import torch


def convert_to_fp8(model) -> None:
    """Swap the model's linear layers for torchao's float8 training layers.

    The output head stays as it is (its logits feed the loss directly), and so
    does any layer whose sizes are not multiples of 16, which fp8 matmuls need.
    """
    from torchao.float8 import convert_to_float8_training

    head = model.get_output_embeddings()

    def eligible(module, _name: str) -> bool:
        # Plain nn.Linear only: a frozen layer (4-bit, streamed, stored compactly; model/frozen.py) subclasses it,
        # and torchao's swap would assign its read-only weight. fp8_problem refuses those runs first.
        return (type(module) is torch.nn.Linear and module is not head
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)

    convert_to_float8_training(model, module_filter_fn=eligible)

"""The torch backend's compute: forward passes into losses, per-sequence and per-token log-probabilities
and scores, held-out loss, logits, sampling and greedy decoding; `TorchBackend` (backend.py) is this plus
models, adapters and training state, as the MLX backend keeps forward.py and generation.py apart from its
facade.

Under FSDP, compute outside a training step sees the root's parameters whole (handle.gathered)."""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from ...errors import MudpuppyError
from . import logprobs
from .model.attention import attention_kernels, packing_mask
from .handle import IGNORE_INDEX, LOSS_CHUNK_TOKENS, TorchModel, gathered, unwrap
from .model.heads import head_inputs
from .model.lora_input_cast import lora_inputs_uncast, plain_lora_layers
from .model.vision import backbone, pixel_inputs


class TorchForward:
    """The protocol's compute methods; the backend supplies `plan` and `engine`."""

    def _tensors(self, batch, model, every_position: bool = False,
                 processor=None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Model keyword inputs and the labels. A packed batch gets its per-segment
        positions and a block-diagonal causal mask (see model/attention.py); a vision-language
        model's batch (with its `processor`) gets its pixels (model/vision.py)."""
        dev = self.plan.device
        inputs = {"input_ids": torch.as_tensor(batch.input_ids, device=dev)}
        labels = torch.as_tensor(batch.labels, device=dev)
        if processor is not None:
            inputs.update(pixel_inputs(processor, getattr(batch, "images", None) or [], unwrap(model), dev,
                                       inputs["input_ids"]))
        if getattr(batch, "segment_ids", None) is None:
            if every_position or not _is_right_padded(batch.attention_mask):
                inputs["attention_mask"] = torch.as_tensor(batch.attention_mask, device=dev)
            # Right padding needs no mask when only real positions are read (losses,
            # log-probs): under causal attention a real token only sees earlier
            # positions, all real, so its output is exact without one, and SDPA can
            # run its fused causal kernel instead of the masked path.
            return inputs, labels
        segments = torch.as_tensor(batch.segment_ids, device=dev)
        # Per layer type where the model has sliding-window layers (attention.packing_mask).
        inputs["attention_mask"] = packing_mask(unwrap(model), segments)
        inputs["position_ids"] = torch.as_tensor(batch.position_ids, device=dev)
        return inputs, labels

    @contextlib.contextmanager
    def _autocast(self, handle: TorchModel):
        """Autocast to the compute dtype where there is one, with plain LoRA layers taking their
        inputs in it (model/lora_input_cast.py: PEFT would copy them to fp32 and autocast straight back)."""
        if handle.autocast_dtype is None:
            yield
            return
        with torch.autocast(device_type=self.plan.device.type, dtype=handle.autocast_dtype), \
                lora_inputs_uncast(self._plain_lora(handle)):
            yield

    def _plain_lora(self, handle: TorchModel) -> list:
        if handle.plain_lora is None or handle.plain_lora[0] is not handle.model:
            layers = plain_lora_layers(handle.model) if handle.adapter_type != "none" else []
            # FSDP computing in bf16 under fp16 autocast: A is bf16 there, and PEFT's cast rounds the
            # fp16 input to it, which skipping the cast would not.
            mixed = getattr(self.plan.distributed, "mixed_precision", "auto")
            if handle.autocast_dtype == torch.float16 and mixed == "bf16":
                layers = []
            handle.plain_lora = (handle.model, layers)
        return handle.plain_lora[1]

    def step_kernels(self, handle: TorchModel, batch, compiled: bool = False):
        """What a training micro-batch's forward and backward run under together: the attention
        kernel for its shape (attention.attention_kernels), and plain LoRA layers taking their
        inputs in the compute dtype. The backward recomputes checkpointed layers, and must
        compute them as the forward did.

        The attention kernel is left to SDPA when the layers are compiled (dynamo does not guard
        on the kernel flags: the first micro-batch's choice would be baked in for every width)
        and for vision-language models (the vision tower's attention, over hundreds of patches,
        runs under the same context as the text's)."""
        stack = contextlib.ExitStack()
        ids = getattr(getattr(batch, "batch", batch), "input_ids", None)   # a GRPO RolloutBatch wraps its Batch
        config = getattr(unwrap(handle.model), "config", None)
        heads = getattr(config, "num_attention_heads", None)
        if not compiled and handle.processor is None and heads and getattr(ids, "ndim", 0) == 2:
            stack.enter_context(attention_kernels(self.plan.device, ids.shape[0], ids.shape[1], heads))
        if handle.autocast_dtype is not None:
            stack.enter_context(lora_inputs_uncast(self._plain_lora(handle)))
        return stack

    @gathered
    def loss_sum(self, handle: TorchModel, batch, router_aux: bool = True) -> tuple[torch.Tensor, int]:
        """Summed cross-entropy over loss-carrying tokens, without full-vocab logits for the rest.

        Only positions with a target go through the output head, in chunks, so
        a chat example whose answer is 5 tokens costs 5 rows of logits, not T.

        A mixture-of-experts model whose config sets ``output_router_logits`` adds its router's
        load-balancing loss to its own loss (``router_aux_loss_coef`` times it, per batch); it is
        added here once per loss token, so that the trainer's mean over tokens is the model's own
        loss. `router_aux` False leaves it out (held-out loss and perplexity).
        """
        inputs, labels = self._tensors(batch, handle.model, processor=handle.processor)
        base = unwrap(handle.model)
        inputs, record = logprobs.router_logits_asked(
            base, inputs, router_aux and handle.head is None and handle.processor is None)
        with self._autocast(handle):
            body = backbone(base) if handle.processor is not None else base.get_decoder()
            keep = labels != IGNORE_INDEX
            # The model's own head, post-head scaling or soft-capping included (model/heads.py).
            hidden, head = head_inputs(base, body, inputs, keep, record)
            targets = labels[keep]
            total = hidden.new_zeros((), dtype=torch.float32)
            # At least one (possibly empty) chunk: a batch with no target still yields a loss with a
            # graph, so that every rank of a distributed step takes part in the backward.
            for start in range(0, max(targets.numel(), 1), LOSS_CHUNK_TOKENS):
                logits = head(hidden[start : start + LOSS_CHUNK_TOKENS])
                total = total + torch.nn.functional.cross_entropy(
                    logits, targets[start : start + LOSS_CHUNK_TOKENS], reduction="sum")
        if record is not None and targets.numel():
            total = total + logprobs.aux_term(self, base, record, batch) * targets.numel()
        return total, int(targets.numel())

    def scoring_kernels(self, handle: TorchModel, batch, grad: bool):
        """Under autocast, a pass without gradient (a reference, GRPO's old policy) runs the attention kernel
        the training step runs on the same micro-batch (step_kernels), so that the policy and its reference
        are the same numbers while their weights are: SDPA's own choice on a CPU and the math kernel round
        differently, in bf16 by up to 0.5 nats on a completion's summed log-prob (online DPO's step-1 loss
        was 0.6919, not ln 2). In fp32 they agree to about 1e-6 and SDPA keeps its choice (the oracle tests
        compare that pass with TRL's). A pass with gradient runs inside the trainer's step_kernels."""
        if grad or handle.autocast_dtype is None:
            return contextlib.nullcontext()
        return self.step_kernels(handle, batch)

    @gathered
    def sequence_logprobs(self, handle: TorchModel, batch, grad: bool = True, router_aux: bool = False):
        with self.scoring_kernels(handle, batch, grad):
            return logprobs.sequence_logprobs(self, handle, batch, grad, router_aux)

    @gathered
    def reference_logprobs(self, handle: TorchModel, batch) -> torch.Tensor:
        with self.scoring_kernels(handle, batch, False):
            return logprobs.reference_logprobs(self, handle, batch)

    @gathered
    def token_logprobs(self, handle: TorchModel, batch, grad: bool = True, temperature: float = 1.0,
                       reference: bool = False, entropy: bool = False, router_aux: bool = False):
        with self.scoring_kernels(handle, batch, grad and not reference):
            return logprobs.token_logprobs(self, handle, batch, grad, temperature, reference, entropy, router_aux)

    @gathered
    def token_divergence(self, handle: TorchModel, teacher: TorchModel, batch, divergence, grad: bool = True,
                         temperature: float = 1.0, top_k: int = 0) -> torch.Tensor:
        from .divergence import token_divergence

        return token_divergence(self, handle, teacher, batch, divergence, grad, temperature, top_k)

    @gathered
    def sample(self, handle: TorchModel, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int],
               sampling, seed: int) -> list[list[int]]:
        from .generation.sampling import sample

        return sample(self, handle, prompts, max_new_tokens, stop_ids, sampling, seed)

    def stream(self, handle: TorchModel, prompt: list[int], max_new_tokens: int, stop_ids: list[int],
               sampling, seed: int, on_token) -> None:
        from .generation.streaming import stream_ids

        stream_ids(self, handle, prompt, max_new_tokens, stop_ids, sampling, seed, on_token)

    def open_decoder(self, handle: TorchModel):
        """Continuous batching for `mudpuppy serve` (generation/batch_decode.py)."""
        from .generation.batch_decode import open_decoder

        return open_decoder(self, handle)

    @gathered
    def sequence_scores(self, handle: TorchModel, batch, grad: bool = True) -> torch.Tensor:
        self._require_head(handle, "sequence_classification")
        return logprobs.sequence_scores(self, handle, batch, grad)

    @gathered
    def token_scores(self, handle: TorchModel, batch, grad: bool = True) -> torch.Tensor:
        self._require_head(handle, "token_classification")
        return logprobs.token_scores(self, handle, batch, grad)

    @staticmethod
    def _require_head(handle: TorchModel, head: str) -> None:
        if handle.head != head:
            raise MudpuppyError(f"this model was loaded with head {handle.head or 'causal_lm'!r}; "
                                f"scores need load_model(..., head={head!r})")

    @gathered
    @torch.no_grad()
    def evaluate_loss(self, handle: TorchModel, batches) -> tuple[float, int]:
        handle.model.eval()
        total, count = 0.0, 0
        for batch in batches:
            loss, n = self.loss_sum(handle, batch, router_aux=False)
            total += float(loss)
            count += n
        return total, count

    @gathered
    @torch.no_grad()
    def logits(self, handle: TorchModel, batch) -> np.ndarray:
        handle.model.eval()
        inputs, _ = self._tensors(batch, handle.model, every_position=True, processor=handle.processor)
        with self._autocast(handle):
            out = handle.model(**inputs).logits
        return out.float().cpu().numpy()

    @gathered
    def generate(self, handle: TorchModel, prompts: list[list[int]], max_new_tokens: int,
                 stop_ids: list[int]) -> list[list[int]]:
        """Greedy decoding, prompts left-padded into one batch (sampling.greedy)."""
        from .generation.sampling import greedy

        return greedy(self, handle, prompts, max_new_tokens, stop_ids)


def _is_right_padded(mask: np.ndarray) -> bool:
    """True when every row is real tokens followed only by padding (or no padding at all)."""
    mask = np.asarray(mask)
    return bool(mask[:, 0].all() and (np.diff(mask, axis=1) <= 0).all())

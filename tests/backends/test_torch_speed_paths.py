"""The torch backend's shortcuts change no number that anything reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mudpuppy import create_backend, load_config
from mudpuppy.backends.torch.model.attach import store_frozen_linears_in as _store_frozen_linears_in
from mudpuppy.backends.torch.forward import _is_right_padded
from mudpuppy.data import Example, collate


def examples(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [Example(rng.integers(3, 300, n).astype(np.int32), np.ones(n, dtype=bool)) for n in lengths]


def test_right_padding_detection():
    assert _is_right_padded(np.array([[1, 1, 1], [1, 1, 0], [1, 0, 0]]))
    assert not _is_right_padded(np.array([[0, 1, 1], [1, 1, 1]]))     # left padding keeps its mask
    assert not _is_right_padded(np.array([[1, 0, 1]]))


def test_padded_batch_logits_equal_each_example_alone(tiny_config):
    backend = create_backend("cpu", precision="fp32")
    cfg = load_config(tiny_config)
    handle = backend.load_model(cfg.model, "fp32")
    exs = examples([5, 11, 8])
    together = backend.logits(handle, collate(exs, pad_id=0))
    for row, ex in enumerate(exs):
        alone = backend.logits(handle, collate([ex], pad_id=0))
        np.testing.assert_allclose(together[row, : len(ex)], alone[0], atol=1e-5, rtol=0)


def test_bf16_frozen_linears_give_the_same_loss_as_autocasting_fp32_ones(tiny_config):
    backend = create_backend("cpu", precision="bf16")
    cfg = load_config(tiny_config)
    batch = collate(examples([9, 14]), pad_id=0)
    handle = backend.load_model(cfg.model, "bf16")
    backend.attach_adapter(handle, cfg.adapter.model_copy(update={"type": "lora"}))
    base = handle.model.get_base_model()
    linears = [m for m in base.modules() if isinstance(m, torch.nn.Linear) and m is not base.get_output_embeddings()]
    assert all(m.weight.dtype == torch.bfloat16 for m in linears if not m.weight.requires_grad)
    assert all(p.dtype == torch.float32 for p in handle.model.parameters() if p.requires_grad)
    stored_bf16, _ = backend.loss_sum(handle, batch)

    reference = backend.load_model(cfg.model, "bf16")
    reference.autocast_dtype = None        # attach without the conversion...
    backend.attach_adapter(reference, cfg.adapter)
    reference.autocast_dtype = torch.bfloat16   # ...then compute under the same autocast
    reference.model.load_state_dict(handle.model.state_dict(), strict=False)
    with torch.no_grad():
        for name, p in reference.model.named_parameters():
            if p.requires_grad:
                p.copy_(dict(handle.model.named_parameters())[name])
    autocast_fp32, _ = backend.loss_sum(reference, batch)
    assert float(stored_bf16) == pytest.approx(float(autocast_fp32), rel=1e-6)
    assert _store_frozen_linears_in(base, torch.bfloat16) == 0      # idempotent


def test_the_math_attention_kernel_is_chosen_only_for_short_rows_on_a_cpu():
    from mudpuppy.backends.torch.model import attention

    cpu = torch.device("cpu")

    def math(*args):
        with attention.attention_kernels(*args):
            return not torch.backends.cuda.flash_sdp_enabled()

    assert math(cpu, 8, 50, 9)
    assert not math(cpu, 8, attention.MATH_ATTENTION_MAX_WIDTH + 1, 9)       # long rows: the fused kernel
    assert not math(cpu, 64, 128, 32)                                       # too many scores kept
    assert not math(torch.device("cuda"), 8, 50, 9)                         # GPUs keep their fused kernels
    assert torch.backends.cuda.flash_sdp_enabled()                          # restored on exit


def one_step(tiny_config, monkeypatch, math: bool, checkpointing: bool):
    """A training step of the tiny model; returns the loss, the trained weights and, per attention
    call (forward and checkpointing's recompute), whether the fused kernel was allowed."""
    from mudpuppy.backends.torch.model import attention
    from mudpuppy.data import Batcher, load_data, prepare_sft_data

    if not math:
        monkeypatch.setattr(attention, "MATH_ATTENTION_MAX_WIDTH", 0)
    tiny_config["training"]["gradient_checkpointing"] = checkpointing
    cfg = load_config(tiny_config)
    backend = create_backend("cpu", precision="fp32")
    torch.manual_seed(0)
    handle = backend.load_model(cfg.model, "fp32")
    backend.attach_adapter(handle, cfg.adapter)
    fused = []
    attentions = [m for m in handle.model.modules() if type(m).__name__.endswith("Attention")]
    for module in attentions:
        module.register_forward_hook(lambda *_: fused.append(torch.backends.cuda.flash_sdp_enabled()))
    trainer = backend.create_trainer(handle, cfg.training)
    data = prepare_sft_data(cfg, handle.tokenizer, load_data(cfg, "sft"))
    batch = Batcher.from_config(data.train, cfg, handle.tokenizer.pad_token_id).next_batch()
    result = trainer.step([batch], 1e-2)
    trained = {k: v.detach().clone() for k, v in handle.model.named_parameters() if v.requires_grad}
    return result.loss, trained, fused, len(attentions)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_short_batches_train_through_the_math_kernel_to_the_same_weights(tiny_config, monkeypatch, checkpointing):
    """The forward and the recompute inside the backward both take the math kernel (a recompute on
    the other kernel would save different tensors, which checkpointing refuses), and the step
    lands on the weights the fused kernel gives, to fp32 rounding."""
    loss_math, math_weights, fused, layers = one_step(tiny_config, monkeypatch, True, checkpointing)
    assert layers and len(fused) == layers * (2 if checkpointing else 1) and not any(fused)
    monkeypatch.undo()
    loss_fused, fused_weights, fused_calls, _ = one_step(tiny_config, monkeypatch, False, checkpointing)
    assert all(fused_calls)
    assert loss_math == pytest.approx(loss_fused, rel=1e-6)
    for name, value in math_weights.items():
        torch.testing.assert_close(value, fused_weights[name], rtol=0, atol=1e-6)


def test_lora_inputs_skip_the_fp32_round_trip_under_autocast_with_the_same_numbers(tiny_config):
    """Under bf16 autocast plain LoRA layers take their bf16 input as it comes, only inside the
    backend's autocast; the loss and the LoRA gradients are those of PEFT's cast, bit for bit."""
    from mudpuppy.backends.torch.model.lora_input_cast import plain_lora_layers

    backend = create_backend("cpu", precision="bf16")
    cfg = load_config(tiny_config)
    batch = collate(examples([9, 14, 30]), pad_id=0)
    handle = backend.load_model(cfg.model, "bf16")
    backend.attach_adapter(handle, cfg.adapter)
    with torch.no_grad():                       # B starts at zero: make the low-rank path count
        for name, p in handle.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    layers = plain_lora_layers(handle.model)
    assert layers and all(layer.cast_input_dtype_enabled for layer in layers)
    seen = []
    layers[0].register_forward_pre_hook(lambda m, _: seen.append(m.cast_input_dtype_enabled))

    def loss_and_grads():
        handle.model.zero_grad(set_to_none=True)
        loss, _ = backend.loss_sum(handle, batch)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in handle.model.named_parameters() if p.requires_grad}

    uncast_loss, uncast_grads = loss_and_grads()
    assert seen == [False] and all(layer.cast_input_dtype_enabled for layer in layers)   # scoped
    handle.plain_lora = (handle.model, [])      # PEFT's own cast for the reference
    cast_loss, cast_grads = loss_and_grads()
    assert seen == [False, True]
    assert torch.equal(uncast_loss, cast_loss)
    for name, grad in uncast_grads.items():
        assert torch.equal(grad, cast_grads[name]), name


def test_lora_layers_with_dropout_or_a_variant_keep_peft_s_cast(tiny_config):
    from mudpuppy.backends.torch.model.lora_input_cast import plain_lora_layers

    backend = create_backend("cpu", precision="bf16")
    cfg = load_config(tiny_config)
    for update in ({"dropout": 0.1}, {"type": "dora"}):
        handle = backend.load_model(cfg.model, "bf16")
        backend.attach_adapter(handle, cfg.adapter.model_copy(update=update))
        assert plain_lora_layers(handle.model) == [], update


def test_compiled_layers_and_vision_models_leave_the_attention_kernel_to_sdpa(tiny_config):
    """A compiled layer keeps the kernel of its first trace (dynamo does not guard on the flags),
    and a vision tower attends over hundreds of patches: neither gets the short-row kernel."""
    backend = create_backend("cpu", precision="fp32")
    handle = backend.load_model(load_config(tiny_config).model, "fp32")
    batch = collate(examples([9, 14]), pad_id=0)

    def fused_allowed(**options):
        with backend.step_kernels(handle, batch, **options):
            return torch.backends.cuda.flash_sdp_enabled()

    assert not fused_allowed()
    assert fused_allowed(compiled=True)
    handle.processor = object()
    assert fused_allowed()

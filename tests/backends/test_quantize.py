"""Our own 4-bit quantizers (int4, MXFP4), Linear4bit, and QLoRA through PEFT on a tiny Llama."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mudpuppy.backends.torch.quantization.formats import (
    E2M1_MAGNITUDES,
    choose_shared_exponents,
    dequantize_int4,
    dequantize_mxfp4,
    encode_e2m1,
    pack_nibbles,
    quantize_int4,
    quantize_mxfp4,
    unpack_nibbles,
)
from mudpuppy.backends.torch.quantization.linear4bit import (
    Linear4bit,
    dequantize_model,
    quantize_model,
)
from mudpuppy.errors import MudpuppyError

# Relative Frobenius error ||W - deq(q(W))|| / ||W|| for W ~ N(0, 1), measured on
# 1536x576, 576x1536 and 256x4096 (3 seeds each): int4 group 64 0.0896-0.0897,
# group 128 0.0986-0.0998, per-row 0.119 (576-wide rows) to 0.140 (4096-wide), MXFP4 0.1148-0.1151.
# The bounds leave ~10% headroom.
INT4_BOUNDS = {64: 0.10, 128: 0.11, None: 0.145}
MXFP4_BOUND = 0.125
# The tiny random Llama (hidden 32, weights of std 0.2) amplifies any weight error:
# Gaussian noise of the same energy as int4's (8% of each weight) moves its logits by
# 0.36 (relative Frobenius). Measured after quantization: int4 group 64 0.35, MXFP4 0.46.
# A broken dequantizer (lost signs, swapped nibbles, rows shifted by one) measured 1.37-1.43.
LOGIT_BOUND = 0.6


def relative_error(weight: torch.Tensor, rebuilt: torch.Tensor) -> float:
    return ((weight - rebuilt).norm() / weight.norm()).item()


def load_tiny(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def fixed_batch(vocab: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (4, 24), generator=generator)


# --------------------------------------------------------------------------- formats


def test_pack_unpack_is_lossless_for_every_byte():
    every_byte = torch.arange(256, dtype=torch.uint8)
    codes = unpack_nibbles(every_byte)
    assert codes.shape == (512,) and int(codes.max()) == 15
    assert torch.equal(codes[0::2], every_byte & 0x0F)  # low nibble first
    assert torch.equal(pack_nibbles(codes), every_byte)
    all_pairs = torch.cartesian_prod(torch.arange(16), torch.arange(16)).to(torch.uint8).flatten()
    assert torch.equal(unpack_nibbles(pack_nibbles(all_pairs)), all_pairs)


@pytest.mark.parametrize("group_size", [16, 64, None])
def test_int4_round_trips_a_16_level_grid_exactly(group_size):
    generator = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (8, 64), generator=generator).float()
    codes[:, 0], codes[:, 1] = 0, 15  # each group must reach both ends of its grid
    codes[:, 32], codes[:, 33] = 0, 15
    codes[:, 16], codes[:, 17], codes[:, 48], codes[:, 49] = 0, 15, 0, 15
    steps = torch.tensor([0.25, 0.5, 0.125, 1.0, 2.0, 0.0625, 0.75, 0.375]).unsqueeze(1)
    offsets = torch.tensor([-2.0, -1.0, 0.5, -8.0, 3.0, -0.5, -6.0, 0.0]).unsqueeze(1)
    weight = codes * steps + offsets
    rebuilt = dequantize_int4(**quantize_int4(weight, group_size), in_features=64)
    assert torch.equal(rebuilt, weight)


def test_mxfp4_round_trips_scaled_e2m1_values_exactly():
    generator = torch.Generator().manual_seed(2)
    magnitudes = torch.tensor(E2M1_MAGNITUDES)
    values = magnitudes[torch.randint(0, 8, (6, 64), generator=generator)]
    values = values * torch.where(torch.rand(6, 64, generator=generator) < 0.5, -1.0, 1.0)
    values[:, 0], values[:, 32] = 6.0, -6.0  # amax 6 puts the shared exponent on the grid's own scale
    powers = torch.tensor([0, -3, 5, -10, 12, -40]).float()
    weight = torch.ldexp(values, powers.unsqueeze(1))
    rebuilt = dequantize_mxfp4(**quantize_mxfp4(weight), in_features=64)
    assert torch.equal(rebuilt, weight)


def test_mxfp4_negative_zero_code_decodes_to_positive_zero():
    # Code 8 is E2M1's -0; decoding it to +0.0 everywhere keeps the compiled CUDA kernel (which gave +0.0)
    # bit-equal to the eager lookup, so mxfp4 layers are not sent to the eager code on a GPU.
    weight = torch.tensor([[-1e-9] * 31 + [6.0]])              # rounds to code 8 under a scale set by 6.0
    tensors = quantize_mxfp4(weight)
    assert (unpack_nibbles(tensors["qweight"])[0, :31] == 8).all()
    rebuilt = dequantize_mxfp4(**tensors, in_features=32)
    assert not rebuilt[0, :31].signbit().any() and rebuilt[0, 31] == 6.0


def test_mxfp4_shared_exponent_follows_the_ocp_rule():
    amax = torch.tensor([6.0, 7.99, 8.0, 1.0, 0.75, 1e-3, 0.0])
    blocks = torch.zeros(len(amax), 32)
    blocks[:, 5] = -amax
    expected = [0, 0, 1, -2, -3, -12, -127]  # floor(log2(amax)) - 2; zero blocks take the smallest
    assert choose_shared_exponents(blocks).tolist() == expected


def test_e2m1_rounds_to_nearest_ties_to_even_and_saturates():
    scaled = torch.tensor([0.2, 0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 7.9, 100.0, -0.75, -5.0])
    codes = encode_e2m1(scaled)
    magnitudes = torch.tensor(E2M1_MAGNITUDES)[(codes & 0x7).long()]
    signs = torch.where((codes & 0x8) > 0, -1.0, 1.0)
    expected = [0, 0, 0.5, 1, 1, 2, 2, 4, 4, 6, 6, 6, -1, -4]
    assert (magnitudes * signs).tolist() == expected


@pytest.mark.parametrize("group_size", [64, 128, None])
def test_int4_error_on_random_normal_weights_is_bounded(group_size):
    weight = torch.randn(1536, 576, generator=torch.Generator().manual_seed(0))
    rebuilt = dequantize_int4(**quantize_int4(weight, group_size), in_features=576)
    assert relative_error(weight, rebuilt) < INT4_BOUNDS[group_size]


def test_mxfp4_error_on_random_normal_weights_is_bounded():
    weight = torch.randn(1536, 576, generator=torch.Generator().manual_seed(0))
    rebuilt = dequantize_mxfp4(**quantize_mxfp4(weight), in_features=576)
    assert relative_error(weight, rebuilt) < MXFP4_BOUND


@pytest.mark.parametrize("in_features", [1, 7, 33, 100])
@pytest.mark.parametrize("backend", ["int4", "mxfp4"])
def test_odd_input_widths_are_padded_and_sliced_back(backend, in_features):
    torch.manual_seed(in_features)
    linear = nn.Linear(in_features, 64)
    layer = Linear4bit.from_linear(linear, backend, group_size=64)
    rebuilt = layer.dequantize()
    assert rebuilt.shape == (64, in_features)
    assert layer.qweight.shape[1] * 2 >= in_features
    bound = INT4_BOUNDS[64] if backend == "int4" else MXFP4_BOUND
    # Short rows average over few values (one value per MXFP4 block when in_features=1).
    assert relative_error(linear.weight.detach(), rebuilt) < bound * 1.5


def test_bad_quantization_settings_fail_clearly():
    with pytest.raises(MudpuppyError, match="quant_backend"):
        Linear4bit.from_linear(nn.Linear(8, 8), "nf4")
    with pytest.raises(MudpuppyError, match="even integer"):
        Linear4bit.from_linear(nn.Linear(8, 8), "int4", group_size=33)


# --------------------------------------------------------------------------- Linear4bit


def test_linear4bit_is_an_nn_linear_without_a_full_weight_parameter():
    layer = Linear4bit.from_linear(nn.Linear(576, 1536, bias=False), "int4", group_size=64)
    assert isinstance(layer, nn.Linear)
    assert list(layer.parameters()) == []
    assert all(buf.numel() < 576 * 1536 / 2 + 1 for buf in layer.buffers())
    assert layer.qweight.dtype == torch.uint8 and layer.qweight.shape == (1536, 288)
    assert layer.quantized_bytes() == 1536 * 288 + 2 * 1536 * 9 * 2  # codes + bf16 scales and mins
    assert layer.weight.shape == (1536, 576) and layer.weight.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["int4", "mxfp4"])
def test_forward_matches_a_dense_layer_of_the_dequantized_weight(backend, dtype):
    torch.manual_seed(0)
    layer = Linear4bit.from_linear(nn.Linear(96, 40), backend, group_size=32)
    x = torch.randn(3, 7, 96, dtype=dtype)
    out = layer(x)
    expected = nn.functional.linear(x, layer.dequantize(dtype), layer.bias.to(dtype))
    assert out.dtype == dtype and out.shape == (3, 7, 40)
    torch.testing.assert_close(out, expected)


def test_backward_matches_a_dense_layer_and_leaves_the_base_frozen():
    torch.manual_seed(0)
    layer = Linear4bit.from_linear(nn.Linear(64, 48), "int4", group_size=32)
    dense = nn.Linear(64, 48)
    with torch.no_grad():
        dense.weight.copy_(layer.dequantize())
        dense.bias.copy_(layer.bias)
    x = torch.randn(5, 64, requires_grad=True)
    x_dense = x.detach().clone().requires_grad_(True)
    (layer(x) ** 2).sum().backward()
    (dense(x_dense) ** 2).sum().backward()
    torch.testing.assert_close(x.grad, x_dense.grad)
    assert layer.bias.grad is None and not layer.bias.requires_grad


def test_backward_keeps_no_full_precision_weight_alive():
    layer = Linear4bit.from_linear(nn.Linear(64, 48), "int4")
    saved = []

    def remember(tensor):
        saved.append(tuple(tensor.shape))
        return tensor

    x = torch.randn(5, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(remember, lambda tensor: tensor):
        layer(x).sum().backward()
    assert (48, 64) not in saved and x.grad is not None


def test_autocast_rebuilds_the_weight_in_the_autocast_dtype():
    layer = Linear4bit.from_linear(nn.Linear(64, 32), "mxfp4")
    x = torch.randn(4, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), layer(x), atol=0.05, rtol=0.05)


def test_weight_reads_work_and_writes_raise():
    layer = Linear4bit.from_linear(nn.Linear(32, 16), "int4")
    weight = layer.weight
    assert type(weight * 2) is torch.Tensor  # plain results: nothing read-only leaks out
    assert torch.linalg.norm(weight, dim=1).shape == (16,)
    assert weight.data.ndim == 2  # DoRA reads .data
    writes = {
        "data +=": lambda: weight.data.__iadd__(1),
        "data =": lambda: setattr(weight, "data", torch.zeros(16, 32)),
        "add_": lambda: weight.add_(1),
        "setitem": lambda: weight.__setitem__(0, 1.0),
    }
    for write in writes.values():
        with pytest.raises(MudpuppyError, match="dequantize_model"):
            write()
    torch.testing.assert_close(layer.weight, weight)


# --------------------------------------------------------------------------- whole models


def test_quantized_tiny_llama_keeps_its_logits(tiny_model_dir):
    model = load_tiny(tiny_model_dir)
    ids = fixed_batch(model.config.vocab_size)
    with torch.no_grad():
        reference = model(ids).logits
    for backend in ("int4", "mxfp4"):
        quantized = load_tiny(tiny_model_dir)
        report = quantize_model(quantized, backend, group_size=64)
        assert report.layers == 2 * 7  # q k v o gate up down per block; lm_head (tied) kept
        assert isinstance(quantized.model.layers[0].self_attn.q_proj, Linear4bit)
        assert type(quantized.lm_head) is nn.Linear
        assert not any(p.requires_grad for m in quantized.modules() if isinstance(m, Linear4bit)
                       for p in m.parameters())
        with torch.no_grad():
            logits = quantized(ids).logits
        assert relative_error(reference, logits) < LOGIT_BOUND


def model_memory_bytes(model) -> int:
    """Bytes held by a model's parameters and buffers, each shared tensor counted once: what quantizing frees."""
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


@pytest.mark.parametrize("backend, expected_ratio", [("int4", 4 * 64 / (64 + 8)), ("mxfp4", 64 / 17)])
def test_quantized_linears_take_about_a_third_of_bf16(backend, expected_ratio):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    bf16_bytes = model_memory_bytes(model)
    report = quantize_model(model, backend, group_size=64)
    assert report.compression_ratio == pytest.approx(expected_ratio)
    assert report.compression_ratio > 3.5
    assert bf16_bytes - model_memory_bytes(model) == report.bytes_before - report.bytes_after
    assert "smaller" in report.summary()


def test_a_model_without_linear_layers_is_refused():
    with pytest.raises(MudpuppyError, match="no nn.Linear layers"):
        quantize_model(nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4)))
    model = nn.Sequential(nn.Linear(8, 8))
    quantize_model(model)
    with pytest.raises(MudpuppyError, match="already quantized"):
        quantize_model(model)


# --------------------------------------------------------------------------- PEFT


def attach_lora(model, **options):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, **options)
    return get_peft_model(model, config)


def train_steps(model, ids, steps=20, lr=1e-2) -> list[float]:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("backend, use_dora", [("int4", False), ("mxfp4", False), ("int4", True)])
def test_lora_on_the_quantized_base_trains(tiny_model_dir, backend, use_dora):
    torch.manual_seed(0)
    model = load_tiny(tiny_model_dir)
    quantize_model(model, backend, group_size=32)
    model.activation_checkpointing_enable()  # on by default in mudpuppy runs
    model.enable_input_require_grads()
    peft_model = attach_lora(model, use_dora=use_dora)
    wrapped = peft_model.base_model.model.model.layers[0].mlp.down_proj
    assert isinstance(wrapped.base_layer, Linear4bit)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    losses = train_steps(peft_model, fixed_batch(model.config.vocab_size))
    assert losses[-1] < 0.6 * losses[0]  # measured: 6.48 -> 2.67-2.79


@pytest.mark.parametrize("use_dora", [False, True])
def test_merging_needs_dequantize_model_first_and_then_matches(tiny_model_dir, use_dora):
    torch.manual_seed(0)
    model = load_tiny(tiny_model_dir)
    quantize_model(model, "int4", group_size=32)
    peft_model = attach_lora(model, use_dora=use_dora, init_lora_weights=False).eval()
    ids = fixed_batch(model.config.vocab_size)
    with torch.no_grad():
        unmerged = peft_model(ids).logits
        with peft_model.disable_adapter():
            base = peft_model(ids).logits
    with pytest.raises(MudpuppyError, match="dequantize_model"):
        peft_model.merge_adapter()
    assert dequantize_model(peft_model) == 14
    merged_model = peft_model.merge_and_unload()
    assert not any(isinstance(m, Linear4bit) for m in merged_model.modules())
    with torch.no_grad():
        merged = merged_model(ids).logits
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=0)
    assert (merged - base).abs().max() > 1e-3


def test_quantizing_after_attaching_adapters_is_refused(tiny_model_dir):
    peft_model = attach_lora(load_tiny(tiny_model_dir))
    with pytest.raises(MudpuppyError, match="before attaching"):
        quantize_model(peft_model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
@pytest.mark.parametrize("backend", ["int4", "mxfp4"])
def test_gpu_dequantization_matches_cpu(backend):
    layer = Linear4bit.from_linear(nn.Linear(576, 1536), backend, group_size=64)
    x = torch.randn(8, 576)
    expected = layer(x)
    gpu_layer = layer.to("cuda")
    assert gpu_layer.qweight.device.type == "cuda"
    torch.testing.assert_close(gpu_layer(x.cuda()).cpu(), expected, atol=1e-4, rtol=1e-4)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert gpu_layer(x.cuda()).dtype == torch.bfloat16


@pytest.mark.parametrize("backend,group", [("int4", 64), ("int4", None), ("mxfp4", None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_dequantization_gives_the_eager_values_bit_for_bit(backend, group, dtype, monkeypatch):
    """QLoRA layers dequantize through a compiled kernel per layer shape; a merge rebuilds the base
    from the same codes with the eager code, so the kernel must give exactly the eager result,
    written into the buffer it is handed. 330 inputs: not a whole number of groups or blocks."""
    from mudpuppy.backends.torch.quantization import linear4bit as quantize
    from mudpuppy.backends.torch.quantization.formats import dequantize_weight, quantize_weight

    monkeypatch.setattr(quantize, "FUSED_MIN_WEIGHTS", 0)   # compile even this small layer
    weight = torch.randn(200, 330, generator=torch.Generator().manual_seed(1))
    tensors = quantize_weight(weight, backend, group)
    out = torch.full((200, 330), float("nan"), dtype=dtype)
    fused = quantize.fast_dequantize(tensors, backend, 330, dtype, out=out)
    kernel = quantize._CPU_KERNELS[(backend, *(tuple(t.shape) for t in tensors.values()), 330, dtype)]
    assert kernel is not dequantize_weight, "no fused kernel was built on this machine"
    assert fused.data_ptr() == out.data_ptr()
    assert torch.equal(fused, dequantize_weight(tensors, backend, 330, dtype))
    # A second weight of the same shape runs the same kernel (no second check), and is still exact.
    again = quantize_weight(weight.flip(0) * 3, backend, group)
    assert torch.equal(quantize.fast_dequantize(again, backend, 330, dtype, out=out),
                       dequantize_weight(again, backend, 330, dtype))


def test_a_kernel_that_disagrees_with_the_eager_values_is_not_used(monkeypatch):
    """The first call of each shape compares the compiled kernel with the eager code; one that
    differs (here: made to add one ulp) is dropped for that shape, and the eager values come back."""
    from mudpuppy.backends.torch.quantization import linear4bit as quantize
    from mudpuppy.backends.torch.quantization.formats import dequantize_weight, quantize_weight

    monkeypatch.setattr(quantize, "FUSED_MIN_WEIGHTS", 0)
    monkeypatch.setattr(quantize, "_CPU_KERNELS", {})
    exact = quantize._fused_int4

    def off_by_one_ulp(qweight, scales, mins, in_features, out):
        result = exact(qweight, scales, mins, in_features, out)
        return result.copy_(torch.nextafter(result, torch.full_like(result, float("inf"))))

    monkeypatch.setattr(quantize, "_fused_int4", off_by_one_ulp)
    tensors = quantize_weight(torch.randn(64, 96, generator=torch.Generator().manual_seed(2)), "int4", 32)
    result = quantize.fast_dequantize(tensors, "int4", 96, torch.float32)
    assert list(quantize._CPU_KERNELS.values()) == [dequantize_weight]
    assert torch.equal(result, dequantize_weight(tensors, "int4", 96, torch.float32))


def test_frozen_layers_reuse_one_scratch_buffer_and_train_as_before():
    """Forward and backward of frozen layers materialize into one reused buffer per dtype on a CPU;
    the outputs and gradients equal F.linear on the dequantized weight, layer after layer."""
    from mudpuppy.backends.torch.model.frozen import scratch_weight

    torch.manual_seed(0)
    big = Linear4bit.from_linear(nn.Linear(96, 160), "int4", group_size=32)
    small = Linear4bit.from_linear(nn.Linear(160, 48), "int4", group_size=32)
    x = torch.randn(5, 96, requires_grad=True)
    y = small(big(x))
    y.square().sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    y2 = F.linear(F.linear(x2, big.dequantize(), big.bias), small.dequantize(), small.bias)
    y2.square().sum().backward()
    assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad)
    first, second = scratch_weight(big, torch.float32), scratch_weight(small, torch.float32)
    assert first.shape == (160, 96) and second.shape == (48, 160)
    assert first.data_ptr() == second.data_ptr()      # one buffer, viewed at each layer's shape


def test_a_shape_compiles_once_whether_called_under_autocast_or_not(monkeypatch):
    """A frozen layer's forward runs under autocast and its backward outside it; dynamo guards
    on that state, so without a fixed one each shape would compile a second, unchecked kernel."""
    from torch._dynamo.utils import counters

    from mudpuppy.backends.torch.quantization import linear4bit as quantize
    from mudpuppy.backends.torch.quantization.formats import dequantize_weight, quantize_weight

    monkeypatch.setattr(quantize, "FUSED_MIN_WEIGHTS", 0)
    tensors = quantize_weight(torch.randn(72, 136, generator=torch.Generator().manual_seed(3)), "int4", 8)
    out = torch.empty(72, 136, dtype=torch.bfloat16)
    before = counters["stats"]["unique_graphs"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        quantize.fast_dequantize(tensors, "int4", 136, torch.bfloat16, out=out)
    compiled = counters["stats"]["unique_graphs"] - before
    with torch.enable_grad():
        again = quantize.fast_dequantize(tensors, "int4", 136, torch.bfloat16, out=out)
    assert compiled == 1 and counters["stats"]["unique_graphs"] - before == 1
    assert quantize.same_bits(again, dequantize_weight(tensors, "int4", 136, torch.bfloat16))


def test_same_bits_tells_signed_zeros_apart_and_a_nan_equal_to_itself():
    from mudpuppy.backends.torch.quantization.linear4bit import same_bits

    assert not same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert same_bits(torch.tensor([float("nan"), 1.0]).bfloat16(), torch.tensor([float("nan"), 1.0]).bfloat16())


def test_the_scratch_buffer_first_made_under_inference_mode_still_serves_training():
    """An inference tensor cannot be written outside inference mode: a first forward under
    torch.inference_mode must not leave every later training step unable to rebuild weights."""
    import threading

    result = {}

    def run():     # a fresh thread: a fresh set of scratch buffers
        layer = Linear4bit.from_linear(nn.Linear(64, 48), "int4", group_size=32)
        x = torch.randn(3, 64)
        with torch.inference_mode():
            expected = layer(x)
        x.requires_grad_(True)
        y = layer(x)
        y.sum().backward()
        result["ok"] = torch.equal(y.detach(), expected) and x.grad is not None

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert result.get("ok")


def test_the_gpu_dequantizer_is_built_and_checked_per_format_and_dtype(monkeypatch):
    """The GPU path, run on the CPU with torch.compile stood in for: each (format, dtype) gets its own
    compiled function (its own recompile budget) and its own bit-for-bit check, so a format inductor gets
    wrong falls back alone; every call runs with autocast off and grad off, whatever the caller's state."""
    from mudpuppy.backends.torch import compile as torch_compile
    from mudpuppy.backends.torch.quantization import linear4bit as q

    compiled_codes, states = [], []

    def fake_compile(fn, dynamic):
        compiled_codes.append(fn.__code__)

        def run(tensors, backend, in_features, dtype):
            states.append((torch.is_autocast_enabled("cpu"), torch.is_grad_enabled()))
            weight = fn(tensors, backend, in_features, dtype)
            return weight + 1 if backend == "mxfp4" else weight       # inductor "gets mxfp4 wrong"
        return run

    monkeypatch.setattr(q.torch, "compile", fake_compile)
    monkeypatch.setattr(torch_compile, "kernel_toolchain_missing", lambda device: None)
    monkeypatch.delenv(q.EAGER_ENV, raising=False)
    cpu = torch.device("cpu")
    int4_bf16 = q._build_dequantizer(cpu, "int4", torch.bfloat16)
    int4_fp16 = q._build_dequantizer(cpu, "int4", torch.float16)
    mxfp4 = q._build_dequantizer(cpu, "mxfp4", torch.bfloat16)
    assert int4_bf16 is not q.dequantize_weight and int4_fp16 is not q.dequantize_weight
    assert mxfp4 is q.dequantize_weight
    assert len(set(map(id, compiled_codes))) == 3
    assert all(code is not q.dequantize_weight.__code__ for code in compiled_codes)
    from mudpuppy.backends.torch.quantization.formats import quantize_weight

    tensors = quantize_weight(torch.randn(64, 128), "int4", 64)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.enable_grad():
        int4_bf16(tensors, "int4", 128, torch.bfloat16)
    assert set(states) == {(False, False)}

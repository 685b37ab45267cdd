"""The seed's kernels (mudpuppy.quantization) against float references written here, and torchao's grid."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mudpuppy.errors import MudpuppyError
from mudpuppy.quantization import (
    FlashMHA, KernelInputError, dequantize, fbgemm, flash_attention, int_mm_available, pack_int4, qgemm,
    quantize_per_channel, quantize_per_group, quantize_per_tensor, quantize_per_token, quantized_layernorm,
    unpack_int4,
)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def reference_scale(x: torch.Tensor, bits: int, symmetric: bool, dims) -> torch.Tensor:
    """The documented grid's scale in float64, min and max taken over `dims`."""
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    x = x.double()
    lo = torch.clamp(x.amin(dim=dims, keepdim=True), max=0)
    hi = torch.clamp(x.amax(dim=dims, keepdim=True), min=0)
    return torch.maximum(-lo, hi) / ((qmax - qmin) / 2) if symmetric else (hi - lo) / (qmax - qmin)


def check_round_to_nearest(x, q, scale, zero, bits, ref_scale):
    """Scales as documented, codes in range and using it, every value within half a step of x."""
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and zero.dtype == torch.int32
    assert torch.allclose(scale.double().expand_as(ref_scale), ref_scale, rtol=1e-6)
    assert q.min() >= -(2 ** (bits - 1)) and q.max() <= 2 ** (bits - 1) - 1
    assert int(q.max()) == 2 ** (bits - 1) - 1 or int(q.min()) == -(2 ** (bits - 1))   # the range is used
    err = (dequantize(q, scale, zero).double() - x.double()).abs()
    assert (err <= ref_scale * (0.5 + 1e-5)).all()


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [8, 4])
def test_per_tensor_and_per_channel_round_to_nearest_on_the_documented_grid(bits, symmetric):
    x = torch.randn(16, 48) * 3 + (0.0 if symmetric else 0.5)
    q, scale, zero = quantize_per_tensor(x, bits=bits, symmetric=symmetric)      # the seed's 3-tuple
    assert scale.dim() == 0
    check_round_to_nearest(x, q, scale, zero, bits, reference_scale(x, bits, symmetric, dims=(0, 1)))
    for dim in (0, 1):
        q, scale, zero = quantize_per_channel(x, bits=bits, dim=dim, symmetric=symmetric)
        assert scale.shape[dim] == x.shape[dim] and scale.numel() == x.shape[dim]
        check_round_to_nearest(x, q, scale, zero, bits, reference_scale(x, bits, symmetric, dims=1 - dim))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 32), (4, -1)])
def test_per_group_codes_are_torchaos_fake_quantization_bit_for_bit(dtype, bits, group):
    from torchao.quantization.qat import FakeQuantizerBase, IntxFakeQuantizeConfig

    w = torch.randn(24, 128).to(dtype)
    dt = torch.int4 if bits == 4 else torch.int8
    cfg = (IntxFakeQuantizeConfig(dt, "per_channel", is_symmetric=True) if group == -1
           else IntxFakeQuantizeConfig(dt, group_size=group, is_symmetric=True))
    faked = FakeQuantizerBase.from_config(cfg)(w)
    q, scale, _ = quantize_per_group(w, bits, group)
    assert scale.shape == (24, 128 // (128 if group == -1 else group))
    assert q.min() >= -(2 ** (bits - 1)) and q.max() <= 2 ** (bits - 1) - 1
    assert torch.equal(dequantize(q, scale, dtype=dtype), faked)


def test_per_token_codes_are_torchaos_dynamic_activation_quantization():
    from torchao.quantization.qat import FakeQuantizerBase, IntxFakeQuantizeConfig

    x = torch.randn(2, 7, 64) * 4 + 1
    faked = FakeQuantizerBase.from_config(IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False))(x)
    q, scale, zero = quantize_per_token(x)
    assert scale.shape == (2, 7, 1) and zero.shape == (2, 7, 1)
    assert torch.equal(dequantize(q, scale, zero), faked)


def test_an_all_zero_tensor_quantizes_to_zero_codes():
    for q, scale, zero in (quantize_per_tensor(torch.zeros(4, 4)), quantize_per_group(torch.zeros(2, 64), 4, 32)):
        assert (q == 0).all() and torch.isfinite(scale).all() and (dequantize(q, scale, zero) == 0).all()


def dequantized(q, scale, zero=None):
    return dequantize(q, scale, zero).double()


def test_qgemm_per_tensor_matches_matmul_of_the_dequantized_operands():
    a, b = torch.randn(8, 40), torch.randn(40, 12)
    qa, sa, _ = quantize_per_tensor(a)
    qb, sb, _ = quantize_per_tensor(b)
    out = qgemm(qa, sa, qb, sb)                                     # the seed's call
    ref = dequantized(qa, sa) @ dequantized(qb, sb)
    assert out.dtype == torch.float32 and torch.allclose(out.double(), ref, rtol=1e-6, atol=1e-5)


def test_qgemm_with_zero_points_rows_and_groups_matches_the_reference():
    a = torch.randn(5, 3, 96) * 2 + 0.7                  # batched rows, asymmetric per token
    w = torch.randn(20, 96)                              # [out, in]: per-group along in
    qa, sa, za = quantize_per_token(a)
    qw, sw, _ = quantize_per_group(w, 8, 32)
    out = qgemm(qa, sa, qw.t(), sw.t(), a_zero_point=za)
    ref = dequantized(qa, sa, za) @ dequantized(qw, sw).t()
    assert out.shape == (5, 3, 20)
    assert torch.allclose(out.double(), ref, rtol=1e-6, atol=1e-5)
    # asymmetric b per column too
    b = torch.rand(96, 16) + 0.2
    qb, sb, zb = quantize_per_channel(b, dim=1, symmetric=False)
    out = qgemm(qa, sa, qb, sb.reshape(-1), a_zero_point=za, b_zero_point=zb.reshape(-1))
    ref = dequantized(qa, sa, za) @ dequantized(qb, sb, zb)
    assert torch.allclose(out.double(), ref, rtol=1e-6, atol=1e-5)


def test_int_mm_and_fallback_paths_give_the_same_exact_integers():
    # K above the fallback's 1024 slice, codes at the int8 extremes: sums far beyond float32's 2^24
    a = torch.randint(-128, 128, (33, 3000), dtype=torch.int8)
    b = torch.randint(-128, 128, (3000, 24), dtype=torch.int8)
    a[0], b[:, 0] = -128, -128
    exact = (a.long() @ b.long()).double()
    assert exact.abs().max() > 2 ** 24
    int_mm = qgemm(a, 1.0, b, 1.0, use_int_mm=True, out_dtype=torch.float64)
    fallback = qgemm(a, 1.0, b, 1.0, use_int_mm=False, out_dtype=torch.float64)
    assert torch.equal(int_mm, exact) and torch.equal(fallback, exact)
    # with real scales, grouped and zero-pointed, the two paths agree bit for bit
    x, w = torch.randn(33, 256), torch.randn(40, 256)
    qx, sx, zx = quantize_per_token(x)
    qw, sw, _ = quantize_per_group(w, 4, 64)
    one = qgemm(qx, sx, qw.t(), sw.t(), zx, use_int_mm=True)
    two = qgemm(qx, sx, qw.t(), sw.t(), zx, use_int_mm=False)
    assert torch.equal(one, two)
    assert not int_mm_available(qx, qw.t())        # on a CPU the exact float path is the default
    with torch.autocast("cpu", dtype=torch.bfloat16):      # autocast must not round the integer sums
        assert torch.equal(qgemm(a, 1.0, b, 1.0, out_dtype=torch.float64), exact)


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "silu", "tanh", "sigmoid"])
def test_fbgemm_is_qgemm_plus_bias_then_activation(activation):
    a, b, bias = torch.randn(6, 32), torch.randn(32, 10), torch.randn(10)
    qa, sa, _ = quantize_per_tensor(a)
    qb, sb, _ = quantize_per_channel(b, dim=1)
    out = fbgemm(qa, sa, qb, sb.reshape(-1), bias=bias, activation=activation)
    pre = dequantized(qa, sa) @ dequantized(qb, sb) + bias.double()
    fn = {None: lambda t: t, "relu": F.relu, "gelu": F.gelu, "silu": F.silu, "tanh": torch.tanh,
          "sigmoid": torch.sigmoid}[activation]
    assert torch.allclose(out.double(), fn(pre), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("per_row", [False, True])
def test_quantized_layernorm_matches_layer_norm_of_the_dequantized_input(per_row):
    x = torch.randn(4, 9, 64) * 3 + 1
    weight, bias = torch.rand(64) + 0.5, torch.randn(64)
    qx, sx, zx = quantize_per_token(x)
    q, scale, zero = quantized_layernorm(qx, sx, weight, bias, x_zero_point=zx, per_row=per_row)
    ref = F.layer_norm(dequantized(qx, sx, zx), (64,), weight.double(), bias.double(), 1e-5)
    assert scale.shape == ((4, 9, 1) if per_row else ())
    # within half a step of the output grid (plus float32 rounding)
    assert ((dequantized(q, scale, zero) - ref).abs() <= scale.double() * 0.5 + 1e-5).all()


def reference_attention(q, k, v, mask=None, causal=False):
    """softmax(q k^T / sqrt(d) + mask) v in float64, heads expanded for grouped-query attention."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))     # [B, H, T, D]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(~torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    return (scores.softmax(-1) @ v).transpose(1, 2)


def test_flash_attention_matches_softmax_attention():
    q, k, v = torch.randn(2, 7, 4, 16), torch.randn(2, 7, 4, 16), torch.randn(2, 7, 4, 16)
    assert torch.allclose(flash_attention(q, k, v).double(), reference_attention(q, k, v), atol=1e-5)
    assert torch.allclose(flash_attention(q, k, v, causal=True).double(),
                          reference_attention(q, k, v, causal=True), atol=1e-5)
    keep = torch.rand(2, 1, 7, 7) > 0.3
    keep[..., 0] = True                                # no fully masked row
    assert torch.allclose(flash_attention(q, k, v, mask=keep).double(), reference_attention(q, k, v, mask=keep),
                          atol=1e-5)
    bias = torch.randn(2, 4, 7, 7)
    assert torch.allclose(flash_attention(q, k, v, mask=bias).double(), reference_attention(q, k, v, mask=bias),
                          atol=1e-5)
    k2, v2 = torch.randn(2, 7, 2, 16), torch.randn(2, 7, 2, 16)      # grouped-query attention
    assert torch.allclose(flash_attention(q, k2, v2, causal=True).double(),
                          reference_attention(q, k2, v2, causal=True), atol=1e-5)
    dropped = flash_attention(q, k, v, dropout_p=0.5)
    assert torch.isfinite(dropped).all() and not torch.allclose(dropped, flash_attention(q, k, v))


def test_flash_mha_matches_torch_multihead_attention():
    mha = FlashMHA(embed_dim=32, num_heads=4, dropout=0.1).eval()
    ref = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()
    with torch.no_grad():
        ref.in_proj_weight.copy_(mha.qkv.weight)
        ref.in_proj_bias.copy_(mha.qkv.bias)
        ref.out_proj.weight.copy_(mha.out_proj.weight)
        ref.out_proj.bias.copy_(mha.out_proj.bias)
    x = torch.randn(3, 6, 32)
    causal = ~torch.ones(6, 6, dtype=torch.bool).tril()              # MultiheadAttention: True = blocked
    want, _ = ref(x, x, x, attn_mask=causal, need_weights=False)
    assert torch.allclose(mha(x, causal=True), want, atol=1e-5)
    padding = torch.ones(3, 6, dtype=torch.long)
    padding[1, 4:] = 0
    want, _ = ref(x, x, x, key_padding_mask=padding == 0, attn_mask=causal, need_weights=False)
    assert torch.allclose(mha(x, attention_mask=padding, causal=True), want, atol=1e-5)
    mha.train()
    assert not torch.allclose(mha(x), mha.eval()(x))              # dropout only in training mode


def test_int4_packing_round_trips():
    q = torch.randint(-8, 8, (5, 64), dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 32)
    assert torch.equal(unpack_int4(packed), q)
    assert int(packed[0, 0]) == (int(q[0, 0]) + 8) | ((int(q[0, 1]) + 8) << 4)


def test_bad_input_gets_one_clear_error():
    x = torch.randn(4, 48)
    cases = [
        (lambda: quantize_per_tensor(x, bits=9), "bits"),
        (lambda: quantize_per_tensor(x.to(torch.int8)), "floating-point"),
        (lambda: quantize_per_group(x, 4, 32), "does not divide"),
        (lambda: quantize_per_channel(x, dim=3), "out of range"),
        (lambda: qgemm(x, 1.0, x.t(), 1.0), "int8"),
        (lambda: qgemm(x.to(torch.int8), 1.0, torch.zeros(40, 3, dtype=torch.int8), 1.0), "inner dimensions"),
        (lambda: qgemm(x.to(torch.int8), torch.ones(3, 1), torch.zeros(48, 3, dtype=torch.int8), 1.0), "a_scale"),
        (lambda: qgemm(x.to(torch.int8), 1.0, torch.zeros(48, 3, dtype=torch.int8), torch.ones(5, 3)), "b_scale"),
        (lambda: fbgemm(x.to(torch.int8), 1.0, torch.zeros(48, 3, dtype=torch.int8), 1.0, activation="swish"),
         "activation"),
        (lambda: dequantize(torch.zeros(4, 48, dtype=torch.int8), torch.ones(4, 5)), "per group"),
        (lambda: flash_attention(torch.randn(2, 3, 4), torch.randn(2, 3, 4), torch.randn(2, 3, 4)), "[batch"),
        (lambda: flash_attention(*(torch.randn(1, 3, 2, 4),) * 3, causal=True, mask=torch.ones(3, 3).bool()),
         "not both"),
        (lambda: FlashMHA(30, 4), "multiple"),
        (lambda: pack_int4(torch.full((2, 2), 9, dtype=torch.int8)), "4 bits"),
    ]
    for call, words in cases:
        with pytest.raises(KernelInputError) as err:
            call()
        assert words in str(err.value)
        assert isinstance(err.value, ValueError) and isinstance(err.value, MudpuppyError)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_int_mm_on_the_gpu_gives_the_cpu_result_bit_for_bit():
    from mudpuppy.quantization import QuantizedLinear

    x, w = torch.randn(40, 256), torch.randn(64, 256)
    qx, sx, zx = quantize_per_token(x)
    qw, sw, _ = quantize_per_group(w, 4, 32)
    on_cpu = qgemm(qx, sx, qw.t(), sw.t(), zx)
    gpu = [t.cuda() for t in (qx, sx, qw, sw, zx)]
    assert int_mm_available(gpu[0], gpu[2].t())               # M > 16, K and N multiples of 8
    assert torch.equal(qgemm(gpu[0], gpu[1], gpu[2].t(), gpu[3].t(), gpu[4]).cpu(), on_cpu)
    layer = QuantizedLinear.from_weight(w, torch.randn(64), 4, 32, activations="int8")
    want = layer(x)
    assert torch.allclose(layer.cuda()(x.cuda()).cpu(), want, rtol=1e-6, atol=1e-6)

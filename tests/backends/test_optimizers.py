"""The torch optimizers: host offload is exact, resume is exact, torchao's low-bit AdamW is AdamW.

Offload runs here with host and device both the CPU: DevicePlan is built directly
(cpu.create refuses offload on the cpu backend), and HostOffloadOptimizer still keeps
separate host masters, so every copy of the mechanism runs. The loop below is the
trainer's: zero_grad, backward, clip_grad_norm_ on the device gradients, lr set on
param_groups, step.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn
from mudpuppy.backends.torch import optimizers
from mudpuppy.backends.torch.backend import DevicePlan
from mudpuppy.backends.torch.optimizers import (
    HostOffloadOptimizer, build_optimizer, check_optimizer, uses_torchao_offload)
from mudpuppy.config import MemoryConfig, TrainingConfig
from mudpuppy.errors import MudpuppyError

CPU = torch.device("cpu")
PLAIN = DevicePlan("cpu", CPU)
OFFLOAD = DevicePlan("cpu", CPU, memory=MemoryConfig(optimizer_offload=True))
STEPS = 6
# torchao's state tensors lack a hash for torch.compile's on-disk cache: harmless here.
pytestmark = pytest.mark.filterwarnings("ignore:.*_stable_hash_for_caching")
# One low-bit config for every torchao test: its betas and decay are baked into the
# compiled update, so sharing them compiles once. Betas differ from the defaults to
# prove they reach torchao.
LOW_BIT = dict(learning_rate=1e-2, adam_beta1=0.8, adam_beta2=0.99, weight_decay=0.1, max_grad_norm=None)


def tiny_mlp(seed: int, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)


class Wide(nn.Module):
    """One 64x128 weight: 8192 values, over torchao's 4096 and a multiple of its blocks,
    so its low-bit AdamW really quantizes both moments."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(64, 128) * 0.1)

    def forward(self, x):
        return torch.tanh(x @ self.weight.T)


def batches(n_in: int, n_out: int, steps: int = STEPS) -> list:
    gen = torch.Generator().manual_seed(1234)
    return [(torch.randn(16, n_in, generator=gen), torch.randn(16, n_out, generator=gen)) for _ in range(steps)]


MLP_DATA, WIDE_DATA = batches(8, 4), batches(128, 64)


def train(model, optimizer, cfg, data, lrs=None) -> tuple[list[float], list[float]]:
    """The trainer's step, once per batch; returns the losses and pre-clip gradient norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    clip = cfg.max_grad_norm if cfg.max_grad_norm is not None else math.inf
    losses, norms = [], []
    for i, (x, y) in enumerate(data):
        optimizer.zero_grad(set_to_none=True)
        dtype, device = params[0].dtype, params[0].device
        loss = nn.functional.mse_loss(model(x.to(device, dtype)).float(), y.to(device))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
        for group in optimizer.param_groups:
            group["lr"] = cfg.learning_rate if lrs is None else lrs[i]
        optimizer.step()
        losses.append(loss.item())
    return losses, norms


def weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def run(cfg, plan, make_model, data, lrs=None):
    model = make_model(0)
    optimizer = build_optimizer(list(model.parameters()), cfg, plan)
    losses, norms = train(model, optimizer, cfg, data, lrs)
    return losses, weights(model), norms


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a, b)), [float((x - y).abs().max()) for x, y in zip(a, b)]


# ------------------------------------------------------------------ offload

@pytest.mark.parametrize("cfg", [
    TrainingConfig(optimizer="adamw", learning_rate=1e-2, weight_decay=0.1, max_grad_norm=None),
    TrainingConfig(optimizer="adamw", learning_rate=1e-2, weight_decay=0.1, max_grad_norm=0.05),
    TrainingConfig(optimizer="sgd", learning_rate=5e-2, momentum=0.9, weight_decay=0.01, max_grad_norm=None),
    TrainingConfig(optimizer="adafactor", learning_rate=1e-2, max_grad_norm=None),
], ids=["adamw", "adamw-clipped", "sgd-momentum", "adafactor"])
def test_offload_trains_exactly_like_the_device_optimizer(cfg):
    plain_losses, plain_weights, norms = run(cfg, PLAIN, tiny_mlp, MLP_DATA)
    losses, final, _ = run(cfg, OFFLOAD, tiny_mlp, MLP_DATA)
    assert not any(torch.equal(a, b) for a, b in zip(final, weights(tiny_mlp(0))))   # every tensor trained
    if cfg.max_grad_norm is not None:
        assert max(norms) > 2 * cfg.max_grad_norm           # the clip really bites
    assert losses == plain_losses
    assert_same(final, plain_weights)


def test_offload_keeps_separate_fp32_masters_on_the_host():
    model = tiny_mlp(0, torch.bfloat16)
    params = list(model.parameters())
    optimizer = build_optimizer(params, TrainingConfig(), OFFLOAD)
    assert isinstance(optimizer, HostOffloadOptimizer)
    assert [p for g in optimizer.param_groups for p in g["params"]] == params   # device params, for GradScaler
    for param, master in zip(params, optimizer.masters):
        assert master.dtype == torch.float32 and master.data_ptr() != param.data_ptr()
        assert torch.equal(master, param.float())


def test_offload_with_adamw_8bit_matches_adamw_8bit_on_the_device():
    cfg = TrainingConfig(optimizer="adamw_8bit", **LOW_BIT)
    plain_losses, plain_weights, _ = run(cfg, PLAIN, Wide, WIDE_DATA)
    losses, final, _ = run(cfg, OFFLOAD, Wide, WIDE_DATA)
    assert losses == plain_losses
    assert_same(final, plain_weights)


def test_lr_set_on_param_groups_takes_effect_with_offload():
    cfg = TrainingConfig(optimizer="adamw", learning_rate=1e-2, weight_decay=0.1, max_grad_norm=None)
    lrs = [1e-2, 0.0, 3e-2, 0.0, 1e-3, 2e-2]
    model = tiny_mlp(0)
    optimizer = build_optimizer(list(model.parameters()), cfg, OFFLOAD)
    for step, lr in enumerate(lrs):
        before = weights(model)
        train(model, optimizer, cfg, MLP_DATA[step:step + 1], [lr])
        moved = any(not torch.equal(a, b) for a, b in zip(before, weights(model)))
        assert moved == (lr > 0), f"step {step}: lr {lr}"
    _, plain_weights, _ = run(cfg, PLAIN, tiny_mlp, MLP_DATA, lrs)
    assert_same(weights(model), plain_weights)


def test_grad_scaler_unscales_and_steps_the_offload_optimizer():
    """fp16 runs step through GradScaler: it unscales the gradients of param_groups' (device)
    parameters before clipping, then calls step(); offload must give the plain result."""
    cfg = TrainingConfig(optimizer="adamw", learning_rate=1e-2, max_grad_norm=0.05)
    results = []
    for plan in (PLAIN, OFFLOAD):
        model = tiny_mlp(0)
        params = list(model.parameters())
        optimizer = build_optimizer(params, cfg, plan)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        for x, y in MLP_DATA:
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
        results.append(weights(model))
    assert_same(*results)


# ------------------------------------------------------------------ resume

def save(model, optimizer) -> bytes:
    buffer = io.BytesIO()
    torch.save({"weights": weights(model), "optimizer": optimizer.state_dict()}, buffer)
    return buffer.getvalue()


def resume(saved: bytes, cfg, plan, make_model):
    """In state.py's order: a fresh model (other init) and its trainer's optimizer, then the
    weights restored, then the optimizer state (offload's masters must follow the weights)."""
    state = torch.load(io.BytesIO(saved), map_location="cpu", weights_only=True)
    model = make_model(99)
    optimizer = build_optimizer(list(model.parameters()), cfg, plan)
    with torch.no_grad():
        for param, value in zip(model.parameters(), state["weights"]):
            param.copy_(value)
    optimizer.load_state_dict(state["optimizer"])
    return model, optimizer


@pytest.mark.parametrize("name, plan, make_model, data, resume_plan", [
    ("adamw", OFFLOAD, tiny_mlp, MLP_DATA, OFFLOAD),
    ("adamw", PLAIN, tiny_mlp, MLP_DATA, PLAIN),
    ("adamw", PLAIN, tiny_mlp, MLP_DATA, OFFLOAD),      # offload switched on at resume: same layout
    ("sgd", OFFLOAD, tiny_mlp, MLP_DATA, OFFLOAD),
    ("adamw-bf16", OFFLOAD, lambda seed: tiny_mlp(seed, torch.bfloat16), MLP_DATA, OFFLOAD),
    ("adamw_8bit", OFFLOAD, Wide, WIDE_DATA, OFFLOAD),
    ("adamw_8bit", PLAIN, Wide, WIDE_DATA, PLAIN),
], ids=["adamw-offload", "adamw", "adamw-then-offload", "sgd-offload", "adamw-bf16-offload", "8bit-offload", "8bit"])
def test_resume_from_state_dict_continues_bit_for_bit(name, plan, make_model, data, resume_plan):
    if name == "adamw_8bit":
        cfg = TrainingConfig(optimizer="adamw_8bit", **LOW_BIT)
    else:
        cfg = TrainingConfig(optimizer=name.removesuffix("-bf16"), learning_rate=1e-2, momentum=0.9,
                             weight_decay=0.1, max_grad_norm=0.5)
    check_resume(cfg, plan, make_model, data, resume_plan)


def check_resume(cfg, plan, make_model, data, resume_plan) -> None:
    """Half the steps, save, resume into fresh objects, the other half: the uninterrupted run's result."""
    lrs = [cfg.learning_rate * (1 - i / len(data)) for i in range(len(data))]   # a decaying schedule
    whole_losses, whole_weights, _ = run(cfg, plan, make_model, data, lrs)
    k = len(data) // 2
    model = make_model(0)
    optimizer = build_optimizer(list(model.parameters()), cfg, plan)
    first, _ = train(model, optimizer, cfg, data[:k], lrs[:k])
    model, optimizer = resume(save(model, optimizer), cfg, resume_plan, make_model)
    rest, _ = train(model, optimizer, cfg, data[k:], lrs[k:])
    assert first + rest == whole_losses
    assert_same(weights(model), whole_weights)


# ------------------------------------------------------------------ torchao low-bit AdamW

@pytest.mark.parametrize("name, mean_tol, max_tol", [("adamw_8bit", 0.02, 0.4), ("adamw_4bit", 0.4, 3.0)])
def test_low_bit_adamw_follows_torch_adamw(name, mean_tol, max_tol):
    """Two steps against torch's AdamW, errors in units of lr.

    The first step uses the fp32 moments before torchao stores them quantized, so it
    matches AdamW to rounding; the second reads them back, which is where quantization
    shows. Each AdamW step moves a weight by about lr (m / sqrt(v) ~ +-1); a state
    quantized block-wise to 8 bits (4 bits) is off by about 1% (10%), measured at 0.006 lr
    (0.12 lr) mean and 0.13 lr (0.96 lr) at worst over three seeds, so the tolerances
    leave 3x room while a wrong lr, beta, bias correction or sign costs ~1 lr per weight.
    The lower bound proves the moments were quantized (fp32 moments agree to ~1e-5 lr).
    """
    cfg = TrainingConfig(optimizer=name, **LOW_BIT)
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(64, 128, generator=gen)
    grads = [torch.randn(64, 128, generator=gen) * 1e-2 for _ in range(2)]
    ours, ref = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    optimizer = build_optimizer([ours], cfg, PLAIN)
    reference = torch.optim.AdamW([ref], lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  weight_decay=cfg.weight_decay)
    for grad in grads:
        ours.grad, ref.grad = grad.clone(), grad.clone()
        optimizer.param_groups[0]["lr"] = cfg.learning_rate     # a float, as the trainer sets it
        optimizer.step()
        reference.step()
    assert type(optimizer.state[ours]["exp_avg"]) is not torch.Tensor   # a torchao quantized state
    error = (ours.detach() - ref.detach()).abs() / cfg.learning_rate
    assert float(error.mean()) < mean_tol and float(error.max()) < max_tol, (float(error.mean()), float(error.max()))
    assert float(error.mean()) > mean_tol / 100


@pytest.mark.parametrize("name", ["adamw_8bit", "adamw_4bit"])
def test_low_bit_adamw_lowers_the_loss(name):
    data = [WIDE_DATA[0]] * 12                  # one batch, fitted: the loss must fall
    losses, _, _ = run(TrainingConfig(optimizer=name, **LOW_BIT), PLAIN, Wide, data)
    assert losses[-1] < 0.9 * losses[0], losses


# ------------------------------------------------------------------ refusals and choices

def test_check_optimizer_refuses_low_bit_without_torchao(monkeypatch):
    real = optimizers.importlib.util.find_spec
    monkeypatch.setattr(optimizers.importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] == "torchao" else real(name, *a))
    check_optimizer("cpu", "adamw")             # needs nothing
    with pytest.raises(MudpuppyError, match=r"training\.optimizer: adamw_8bit on the rocm backend .*not installed"):
        check_optimizer("rocm", "adamw_8bit")
    with pytest.raises(MudpuppyError, match="training.optimizer"):
        build_optimizer([nn.Parameter(torch.zeros(4))], TrainingConfig(optimizer="adamw_4bit"), PLAIN)


def test_check_optimizer_refuses_old_torchao_and_missing_compiler(monkeypatch):
    monkeypatch.setattr(optimizers.importlib.metadata, "version", lambda name: "0.9.0")
    with pytest.raises(MudpuppyError, match=r"needs torchao >= 0\.11 .*installed: 0\.9\.0"):
        check_optimizer("cuda", "adamw_4bit")
    monkeypatch.undo()
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(MudpuppyError, match="C.. compiler"):
        check_optimizer("cpu", "adamw_8bit")
    with pytest.raises(MudpuppyError, match="C.. compiler"):   # offloaded, the update runs on the host CPU
        check_optimizer("cuda", "adamw_8bit", memory=MemoryConfig(optimizer_offload=True))


def test_torchao_offload_only_where_its_constraints_hold():
    params = [nn.Parameter(torch.zeros(64, 128))]
    gpu = DevicePlan("cuda", torch.device("cuda"), memory=MemoryConfig(optimizer_offload=True))
    fits = dict(optimizer="adamw", max_grad_norm=None)
    assert uses_torchao_offload(params, TrainingConfig(**fits), gpu)
    assert not uses_torchao_offload(params, TrainingConfig(**fits), OFFLOAD)            # it asserts CUDA
    assert not uses_torchao_offload(params, TrainingConfig(**{**fits, "max_grad_norm": 1.0}), gpu)
    assert not uses_torchao_offload(params, TrainingConfig(**{**fits, "optimizer": "sgd"}), gpu)
    assert not uses_torchao_offload([p.bfloat16() for p in params], TrainingConfig(**fits), gpu)
    scaled = DevicePlan("cuda", torch.device("cuda"), loss_scaling=True, memory=gpu.memory)
    assert not uses_torchao_offload(params, TrainingConfig(**fits), scaled)


GPU_OFFLOAD = DevicePlan("cuda", torch.device("cuda"), memory=MemoryConfig(optimizer_offload=True))
no_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")


@pytest.mark.gpu
@no_gpu
@pytest.mark.parametrize("clip", [None, 0.05], ids=["torchao-offload", "host-offload"])
def test_offload_on_a_gpu_matches_adamw_on_the_gpu(clip):
    cfg = TrainingConfig(optimizer="adamw", learning_rate=1e-2, weight_decay=0.1, max_grad_norm=clip)
    results = []
    for plan in (DevicePlan("cuda", torch.device("cuda")), GPU_OFFLOAD):
        model = Wide(0).cuda()
        optimizer = build_optimizer(list(model.parameters()), cfg, plan)
        results.append((train(model, optimizer, cfg, WIDE_DATA)[0], weights(model)))
    assert isinstance(optimizer, HostOffloadOptimizer) == (clip is not None)   # else torchao's
    (plain_losses, plain_weights), (losses, final) = results
    assert losses == pytest.approx(plain_losses, abs=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(final, plain_weights))


@pytest.mark.gpu
@no_gpu
@pytest.mark.parametrize("clip", [None, 0.05], ids=["torchao-offload", "host-offload"])
def test_offload_on_a_gpu_resumes_bit_for_bit(clip):
    cfg = TrainingConfig(optimizer="adamw", learning_rate=1e-2, weight_decay=0.1, max_grad_norm=clip)
    check_resume(cfg, GPU_OFFLOAD, lambda seed: Wide(seed).cuda(), WIDE_DATA, GPU_OFFLOAD)


"""What the torch backend changes beyond its own objects is scoped (issue 39): transformers' attention table
while a decode runs, per thread; frozen layers' value-less weight reads, per thread; glibc's allocator
setting only when a model loads; the environment only where a GPU backend needs it."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from mudpuppy import create_backend
from mudpuppy.backends import factory
from mudpuppy.backends.torch import backend as backend_mod
from mudpuppy.backends.torch.generation.decode_attention import packed_kv_heads_at_decode
from mudpuppy.backends.torch.model.frozen import StoredLinear, weight_reads_without_values
from mudpuppy.config import ModelConfig

CPU = torch.device("cpu")


def in_thread(target):
    """Start `target` on a thread; the returned join re-raises what it raised."""
    failed = []

    def body():
        try:
            target()
        except BaseException as exc:      # noqa: BLE001 - handed to the test's thread
            failed.append(exc)

    thread = threading.Thread(target=body)
    thread.start()

    def join():
        thread.join(timeout=60)
        assert not thread.is_alive()
        if failed:
            raise failed[0]
    return join


class GroupedQueryAttention(torch.nn.Module):
    num_key_value_groups, is_causal = 2, True


def decode_call(calls: list) -> None:
    """One decode step of 4 query heads on 2 key/value heads through the table's "sdpa", as a model makes it."""
    q, kv = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 5, 8)
    ALL_ATTENTION_FUNCTIONS["sdpa"](GroupedQueryAttention(), q, kv, kv, None)


@pytest.fixture
def sdpa_spy(monkeypatch):
    """(thread name, query shape, enable_gqa) of each SDPA call."""
    calls, real = [], torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        calls.append((threading.current_thread().name, tuple(q.shape), kwargs.get("enable_gqa", False)))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


def test_two_decoding_threads_keep_the_packing_until_the_last_leaves(sdpa_spy):
    a_in, b_in, a_out, b_go = (threading.Event() for _ in range(4))

    def a():
        with packed_kv_heads_at_decode(CPU):
            a_in.set()
            assert b_in.wait(30)
        a_out.set()

    def b():
        assert a_in.wait(30)
        with packed_kv_heads_at_decode(CPU):
            b_in.set()
            assert a_out.wait(30) and b_go.wait(30)
            decode_call(sdpa_spy)                 # after A left: still packed here
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward

    join_a, join_b = in_thread(a), in_thread(b)
    join_a()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not sdpa_attention_forward     # B still holds it
    decode_call(sdpa_spy)                         # this thread holds nothing: transformers' own choice
    b_go.set()
    join_b()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    by_thread = {name == threading.current_thread().name: (shape, gqa) for name, shape, gqa in sdpa_spy}
    assert by_thread[False] == ((1, 2, 2, 8), False)     # packed: [rows, kv heads, group, dim]
    assert by_thread[True] == ((1, 4, 1, 8), True)       # enable_gqa, as without mudpuppy


def test_the_table_gets_back_an_override_someone_else_had_set():
    def theirs(*args, **kwargs):
        return sdpa_attention_forward(*args, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = theirs
    try:
        with packed_kv_heads_at_decode(CPU):
            assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not theirs
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is theirs
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward


def test_value_less_weight_reads_hold_only_in_the_thread_that_asked():
    weight = torch.randn(4, 3)
    layer = StoredLinear.from_weight(weight, None, CPU)
    inside, read = threading.Event(), threading.Event()

    def attaching():
        with weight_reads_without_values():
            inside.set()
            assert read.wait(30)
            assert layer.weight.stride() == (0, 0) and layer.weight.shape == (4, 3)

    join = in_thread(attaching)
    assert inside.wait(30)
    assert torch.equal(layer.weight, weight)            # a decode here reads the real values meanwhile
    read.set()
    join()
    assert torch.equal(layer.weight, weight)


def test_the_allocator_setting_comes_with_loading_a_model_not_with_the_backend(tiny_model_dir, monkeypatch):
    calls = []
    monkeypatch.setattr(backend_mod, "return_freed_host_memory", lambda: calls.append("mallopt"))
    backend = create_backend("cpu")
    assert calls == []
    backend.load_model(ModelConfig(base_model=str(tiny_model_dir)), "fp32")
    assert calls == ["mallopt"]


class Made:
    def __init__(self, name):
        self.name = name


@pytest.mark.parametrize("made, kept", [("cuda", True), ("rocm", True), ("cpu", False), (None, False)])
def test_the_cublas_workspace_stays_set_only_for_a_deterministic_gpu_backend(made, kept, monkeypatch):
    monkeypatch.delenv(factory.CUBLAS_WORKSPACE, raising=False)
    seen = []

    def create(name, options):
        seen.append(os.environ.get(factory.CUBLAS_WORKSPACE))        # set before the probe's first cuBLAS call
        if made is None:
            raise RuntimeError("probe failed")
        return Made(made)

    monkeypatch.setattr(factory, "_create", create)
    try:
        factory.create_backend("auto", deterministic=True)
    except RuntimeError:
        assert made is None
    assert seen == [factory.DETERMINISTIC_WORKSPACE]
    assert os.environ.get(factory.CUBLAS_WORKSPACE) == (factory.DETERMINISTIC_WORKSPACE if kept else None)


def test_the_users_cublas_setting_and_a_non_deterministic_run_are_left_alone(monkeypatch):
    monkeypatch.setattr(factory, "_create", lambda name, options: Made("cuda"))
    monkeypatch.setenv(factory.CUBLAS_WORKSPACE, ":16:8")
    factory.create_backend("cuda", deterministic=True)
    assert os.environ[factory.CUBLAS_WORKSPACE] == ":16:8"
    monkeypatch.delenv(factory.CUBLAS_WORKSPACE)
    factory.create_backend("cuda")
    assert factory.CUBLAS_WORKSPACE not in os.environ

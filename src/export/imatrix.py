"""Importance matrices as llama.cpp reads and writes them: per linear layer, the mean square of each
input column over some text, which the K-quant search (kquants.py) uses as `quant_weights`.

    read_imatrix(path)        llama-imatrix's files, both forms, normalized as llama-quantize does
                              (tools/quantize/quantize.cpp load_imatrix, common/imatrix-loader.cpp):
                                GGUF      tensors `<name>.in_sum2` [n_mat, cols] and `<name>.counts`
                                          [n_mat, 1] (float32), keys imatrix.datasets/chunk_count/
                                          chunk_size; weights = in_sum2 / count (1 where count is 0)
                                legacy    .dat: int32 n_entries, then per entry int32 name length,
                                          name, int32 ncall, int32 nval, float32[nval] =
                                          mean * ncall; optional int32 chunk count and dataset name;
                                          weights = values / ncall
    write_imatrix(path, ...)  the GGUF form, from sums and counts (tools/imatrix/imatrix.cpp save_imatrix)
    gguf_entries(...)         sums collected per Hugging Face linear module (backends/torch/quantization/imatrix.py)
                              renamed to the GGUF tensors they feed, through gguf's TensorNameMap

Nothing here runs a model: collecting is the backend's job.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import MudpuppyError

SUM_SUFFIX, COUNT_SUFFIX = ".in_sum2", ".counts"


@dataclass
class Imatrix:
    weights: dict[str, np.ndarray]                # GGUF tensor name -> float32 [n_mat * cols]
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0


@dataclass
class Stats:
    """What llama-imatrix accumulates for one weight: per-matrix sums of x^2 and rows seen."""
    sums: np.ndarray                              # [n_mat, cols] float64
    counts: np.ndarray                            # [n_mat] int64

    def weights(self) -> np.ndarray:
        """quant_weights as llama-quantize derives them from the GGUF form (load_imatrix)."""
        out = np.ones_like(self.sums, dtype=np.float32)
        seen = self.counts > 0
        out[seen] = (self.sums[seen].astype(np.float32) / self.counts[seen, None].astype(np.float32))
        return out.reshape(-1)


def read_imatrix(path: Path) -> Imatrix:
    path = Path(path)
    if not path.is_file():
        raise MudpuppyError(f"--imatrix {path}: no such file")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    return _read_gguf(path) if magic == b"GGUF" else _read_legacy(path)


def _read_gguf(path: Path) -> Imatrix:
    import gguf

    reader = gguf.GGUFReader(str(path))
    keys = gguf.Keys.IMatrix
    missing = [k for k in (keys.DATASETS, keys.CHUNK_COUNT, keys.CHUNK_SIZE) if k not in reader.fields]
    if missing:        # llama-quantize refuses such a file too ("missing imatrix metadata")
        raise MudpuppyError(f"--imatrix {path}: a GGUF without the imatrix keys {', '.join(missing)}; "
                            "is it an imatrix file written by llama-imatrix?")
    tensors = {t.name: t for t in reader.tensors}
    stats: dict[str, Stats] = {}
    for name, t in tensors.items():
        if not name.endswith(SUM_SUFFIX):
            continue
        base = name[: -len(SUM_SUFFIX)]
        counts = tensors.get(base + COUNT_SUFFIX)
        if counts is None or t.tensor_type.name != "F32" or counts.tensor_type.name != "F32":
            raise MudpuppyError(f"--imatrix {path}: {base} needs F32 {SUM_SUFFIX} and {COUNT_SUFFIX} tensors")
        n_counts = int(np.asarray(counts.data).size)
        sums = np.asarray(t.data, dtype=np.float32).reshape(n_counts, -1)
        stats[base] = Stats(sums, np.rint(np.asarray(counts.data, dtype=np.float32).reshape(-1)).astype(np.int64))
    if not stats:
        raise MudpuppyError(f"--imatrix {path}: no {SUM_SUFFIX} tensors in it")
    datasets = [str(v) for v in reader.fields[keys.DATASETS].contents()]
    return Imatrix({k: s.weights() for k, s in stats.items()}, datasets,
                   int(reader.fields[keys.CHUNK_COUNT].contents()))


def _read_legacy(path: Path) -> Imatrix:
    data = path.read_bytes()
    pos = 0

    def take(fmt: str):
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(data):
            raise MudpuppyError(f"--imatrix {path}: ends early at byte {pos}; not a llama-imatrix .dat file?")
        value = struct.unpack_from(fmt, data, pos)
        pos += size
        return value

    (n_entries,) = take("<i")
    if n_entries < 1:
        raise MudpuppyError(f"--imatrix {path}: no entries (neither a GGUF nor a legacy .dat imatrix)")
    weights: dict[str, np.ndarray] = {}
    for _ in range(n_entries):
        (length,) = take("<i")
        name = bytes(take(f"<{length}s")[0]).decode("utf-8", errors="replace")
        ncall, nval = take("<ii")
        if nval < 1:
            raise MudpuppyError(f"--imatrix {path}: entry {name} holds {nval} values")
        take(f"<{4 * nval}x")                                   # checks the values are all there
        values = np.frombuffer(data, dtype="<f4", count=nval, offset=pos - 4 * nval).astype(np.float32)
        weights[name] = values / np.float32(ncall) if ncall > 0 else values
    chunk_count, datasets = 0, []
    if pos + 4 <= len(data):
        (chunk_count,) = take("<i")
        if pos + 4 <= len(data):
            (length,) = take("<i")
            if length > 0 and pos + length <= len(data):
                datasets = [data[pos:pos + length].decode("utf-8", errors="replace")]
    return Imatrix(weights, datasets, chunk_count)


def write_imatrix(path: Path, stats: dict[str, Stats], datasets: list[str], chunk_count: int,
                  chunk_size: int) -> None:
    """`stats` (GGUF tensor name -> Stats) in llama-imatrix's GGUF form, names sorted as it stores them."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch="imatrix")
    writer.add_type("imatrix")
    writer.add_array(gguf.Keys.IMatrix.DATASETS, list(datasets))
    writer.add_uint32(gguf.Keys.IMatrix.CHUNK_COUNT, int(chunk_count))
    writer.add_uint32(gguf.Keys.IMatrix.CHUNK_SIZE, int(chunk_size))
    for name in sorted(stats):
        s = stats[name]
        writer.add_tensor(name + SUM_SUFFIX, np.ascontiguousarray(s.sums, dtype=np.float32))
        writer.add_tensor(name + COUNT_SUFFIX, s.counts.astype(np.float32).reshape(-1, 1))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_entries(sums: dict[str, tuple[np.ndarray, int]], arch: str, n_layer: int,
                 head_is_token_embd: bool) -> dict[str, Stats]:
    """What a backend collected (Hugging Face module name -> (sum of x^2 per input column, rows seen),
    backends/torch/quantization/imatrix.py) under the GGUF names of the weights those inputs multiply:
    `model.layers.0.mlp.down_proj` -> `blk.0.ffn_down.weight`, through gguf's TensorNameMap for `arch`
    (a gguf.MODEL_ARCH member name, as export/gguf_families rows hold it). When the file has no
    output.weight (`head_is_token_embd`: a tied head), llama.cpp multiplies by token_embd and
    llama-imatrix files the head's inputs under that name. Per-expert modules of a MoE have no
    stacked-expert name here and are left out (llama-quantize then quantizes those without weights)."""
    import gguf

    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch), n_layer)
    out = {}
    for module, (total, rows) in sums.items():
        target = names.get_name(module + ".weight", try_suffixes=(".weight",))
        if target == "output.weight" and head_is_token_embd:
            target = "token_embd.weight"
        if target is not None:
            out[target] = Stats(np.asarray(total, dtype=np.float64).reshape(1, -1), np.asarray([rows], np.int64))
    return out


def stats_for_model(sums: dict[str, tuple[np.ndarray, int]], config: dict, where: str) -> dict[str, Stats]:
    """`gguf_entries` for the model whose config.json is `config`: its family's arch and layer count,
    and whether its GGUF has no output.weight (a tied head in a family that does not write one)."""
    from .gguf import family_of

    family = family_of(config, where)
    head_is_token_embd = bool(config.get("tie_word_embeddings", False)) and family.output != "required"
    return gguf_entries(sums, family.arch, int(config["num_hidden_layers"]), head_is_token_embd)


def quant_weights(stats: dict[str, Stats]) -> dict[str, np.ndarray]:
    """What export/gguf.write_gguf takes as `imatrix`, from collected statistics."""
    return {name: s.weights() for name, s in stats.items()}

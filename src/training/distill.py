"""Knowledge distillation (`method: distill`): a student learns a frozen teacher's next-token distributions,
written once for every backend.

Supports: SFT's data (chat, text, instruction, completion; the loss positions are SFT's); a teacher named by
`distill.teacher` (a local directory, hub id or alias of any family the backend loads) with the student's
vocabulary, loaded frozen at its storage precision or as 4-bit codes (`teacher_quantize`); GKD's mix of
off-policy micro-batches (the teacher's distributions over the data's completions) and on-policy ones (the
student continues each example's prompt with GRPO's sampler, the teacher scores every sampled token),
`distill.lmbda` of them on-policy; TRL 1.16's divergences (forward KL, reverse KL, generalized JSD at
beta; distill_loss.py) at a temperature, over the full vocabulary or the teacher's top-k tokens with a
tail bucket; LoRA, DoRA, QLoRA and full fine-tuning of the student; everything the shared loop offers
(checkpoints with exact resume, held-out loss and early stopping, exact match before and after).

Does not support: teachers with another tokenizer (GOLD's cross-tokenizer alignment), sequence-level KD
(the teacher's own samples), packing, vision-language models.

The loss is summed over the loss tokens of the micro-batch and divided by the step's tokens, as TRL's
`num_items_in_batch` divides it. Setup, loop and save are SFT's (sft.py); the teacher, the batcher that
turns micro-batches on-policy and the objective are here.
"""

from __future__ import annotations

import time

import numpy as np

from ..backends.models import resolve_model
from ..backends.protocol import Sampling
from ..config import AdapterConfig, ModelConfig
from ..data import Batch, Batcher, IGNORE_INDEX, load_data, prepare_sft_data
from ..data.tokenizers import load_text_tokenizer
from ..errors import MudpuppyError
from ..evaluation.heldout import stop_token_ids
from .distill_loss import Divergence
from .loop import save_trained, train_loop
from .results import RunResult
from .rollout import completion_batch
from .session import start_run
from .sft import describe_data, loss_check, measure_model


def run_distill(cfg, backend, overwrite: bool = False, echo=print, callbacks=()) -> RunResult:
    started = time.perf_counter()
    d = cfg.distill
    # -- setup: data problems and a teacher of another vocabulary surface before any weight loads
    loaded = load_data(cfg, "sft")
    check_vocabularies(cfg)
    run = start_run(cfg, backend, overwrite, echo, started, callbacks)   # output_dir locked, student loaded
    handle = run.handle
    teacher = load_teacher(cfg, backend)
    data = prepare_sft_data(cfg, handle.tokenizer, loaded, ranks=backend.ranks)
    run.take_output_dir()
    rep = describe_data(data, echo)
    echo(f"distill ({d.loss}{f' beta {d.beta:g}' if d.loss == 'jsd' else ''}, temperature {d.temperature:g}, "
         f"{f'top {d.top_k} teacher tokens' if d.top_k else 'full vocabulary'}, {d.lmbda:.0%} of micro-batches "
         f"on-policy): teacher {teacher.describe()}")
    measure = measure_model(cfg, backend, handle, data)
    run.measure_before(measure)
    run.attach_adapter()
    trainer = backend.create_trainer(handle, cfg.training)
    batches = Batcher.from_config(data.train, cfg, handle.tokenizer.pad_token_id, ranks=backend.ranks)
    batcher = DistillBatcher(cfg, backend, handle, batches)
    steps = run.restore(trainer, batcher)

    stopped_early = train_loop(cfg, run.state, steps, trainer, batcher, run.checkpoints(trainer, batcher),
                               run.callbacks(), evaluate=loss_check(cfg, backend, handle, data),
                               objective=DistillObjective(backend, teacher, d), echo=echo)

    save_trained(cfg, backend, handle, run.out)
    result = run.result(stopped_early, trainer)
    result.after = run.measure_after(measure)
    return run.finish(result, rep.train_examples, rep.val_examples)


def teacher_model_config(cfg) -> ModelConfig:
    d = cfg.distill
    return ModelConfig(base_model=d.teacher, revision=d.teacher_revision, dtype=cfg.model.dtype,
                       trust_remote_code=cfg.model.trust_remote_code)


def check_vocabularies(cfg) -> None:
    """Refuse a teacher whose tokenizer or output vocabulary is not the student's, naming both, from their
    tokenizers and config.json alone (no weights)."""
    vocabularies = []
    for who, model_cfg in (("student", cfg.model), ("teacher", teacher_model_config(cfg))):
        path = resolve_model(model_cfg.base_model, model_cfg.revision, model_cfg.trust_remote_code).path
        tokenizer = load_text_tokenizer(model_cfg, path)
        vocabularies.append((who, model_cfg.base_model, tokenizer.get_vocab(), output_rows(path)))
    (_, s_name, s_vocab, s_rows), (_, t_name, t_vocab, t_rows) = vocabularies
    if s_vocab != t_vocab:
        differ = sorted(set(s_vocab.items()) ^ set(t_vocab.items()), key=lambda kv: kv[1])[:3]
        raise MudpuppyError(
            f"distill.teacher: the teacher {t_name!r} has a vocabulary of {len(t_vocab):,} tokens and the student "
            f"{s_name!r} one of {len(s_vocab):,}, not the same tokens at the same ids (for example "
            f"{', '.join(f'{tok!r}={i}' for tok, i in differ)}); distillation compares the two models' "
            "distributions token by token, so the teacher must share the student's tokenizer (a larger or "
            "fine-tuned model of the same family)")
    if s_rows is not None and t_rows is not None and s_rows != t_rows:
        raise MudpuppyError(
            f"distill.teacher: the teacher {t_name!r} scores {t_rows:,} tokens (its config.json vocab_size) and "
            f"the student {s_name!r} {s_rows:,}; with the same tokenizer the output vocabularies must have the "
            "same size too (a model resized to another padding of its embedding cannot be distilled into this "
            "student)")


def output_rows(path) -> int | None:
    """config.json's vocab_size (a multimodal model's text_config's), None where it names none."""
    import json

    config_file = path / "config.json"
    if not config_file.exists():
        return None
    config = json.loads(config_file.read_text(encoding="utf-8"))
    return (config.get("text_config") or config).get("vocab_size")


def load_teacher(cfg, backend):
    """The teacher, frozen (no adapter), at its storage precision or as QLoRA's 4-bit codes."""
    quantized = AdapterConfig(type="qlora") if cfg.distill.teacher_quantize else None
    return backend.load_model(teacher_model_config(cfg), cfg.training.precision, adapter=quantized)


class DistillObjective:
    """The trainer's objective (protocol.Objective): the divergence over a micro-batch's loss tokens."""

    def __init__(self, backend, teacher, distill_cfg):
        self.backend, self.teacher, self.cfg = backend, teacher, distill_cfg
        self.divergence = Divergence(backend.ops, distill_cfg.trl_beta)

    def count(self, batch: Batch) -> int:
        return int((np.asarray(batch.labels) != IGNORE_INDEX).sum())

    def __call__(self, handle, batch: Batch, grad: bool = True):
        c = self.cfg
        total = self.backend.token_divergence(handle, self.teacher, batch, self.divergence, grad=grad,
                                              temperature=c.temperature, top_k=c.top_k)
        return total, {}


class DistillBatcher:
    """SFT's micro-batches, each turned on-policy with probability lmbda (GKD): the student samples a
    completion of every example's prompt (what comes before its first loss token), and the micro-batch
    becomes prompt + sample with the sample as the loss tokens. The draw and the sampler's seeds come
    from the run's seed and the micro-batch's index, so a resumed run makes the same micro-batches."""

    def __init__(self, cfg, backend, handle, batches: Batcher):
        d = cfg.distill
        self.cfg, self.backend, self.handle, self.batches = cfg, backend, handle, batches
        self.lmbda, self.max_new = d.lmbda, d.max_completion_length
        self.sampling = Sampling(temperature=d.temperature)
        self.stop_ids = stop_token_ids(handle.tokenizer)
        self.served = 0
        self.made: list[tuple[bool, int]] = []          # (on-policy, sampled tokens) since the last step

    @property
    def epoch(self) -> int:
        return self.batches.epoch

    @property
    def batches_per_epoch(self) -> int:
        return self.batches.batches_per_epoch

    def next_batch(self) -> Batch:
        batch = self.batches.next_batch()
        index, self.served = self.served, self.served + 1
        if not on_policy(self.cfg.training.seed, index, self.lmbda):
            self.made.append((False, 0))
            return batch
        prompts = batch_prompts(batch)
        seeds = [int(np.random.default_rng([self.cfg.training.seed, index, 3, row]).integers(0, 2**62))
                 for row in range(len(prompts))]
        completions = self.backend.sample(self.handle, prompts, self.max_new, self.stop_ids, self.sampling,
                                          seed=seeds)
        self.made.append((True, sum(len(c) for c in completions)))
        return completion_batch(prompts, completions, [True] * len(prompts), self.handle.tokenizer.pad_token_id)

    def pop_metrics(self) -> dict[str, float]:
        """The step's share of on-policy micro-batches, and their sampled tokens per micro-batch."""
        made, self.made = self.made, []
        if not made:
            return {}
        sampled = [n for policy, n in made if policy]
        out = {"on_policy": sum(p for p, _ in made) / len(made)}
        if sampled:
            out["completions/tokens"] = float(np.mean(sampled))
        return out

    def pop_samples(self) -> list[dict]:
        return []

    def state_dict(self) -> dict:
        return {"batches": self.batches.state_dict(), "served": self.served}

    def load_state_dict(self, state: dict) -> None:
        self.batches.load_state_dict(state["batches"])
        self.served = int(state["served"])


def on_policy(seed: int, index: int, lmbda: float) -> bool:
    """Whether micro-batch `index` is sampled by the student: a function of the seed and the index alone."""
    return bool(np.random.default_rng([seed, index, 4]).random() < lmbda)


def batch_prompts(batch: Batch) -> list[list[int]]:
    """Each row's prompt: its tokens up to and including the one before its first loss token (labels are
    aligned so that label t is the target of input t); a row without loss tokens keeps its real tokens."""
    ids, labels = np.asarray(batch.input_ids), np.asarray(batch.labels)
    mask = np.asarray(batch.attention_mask).astype(bool)
    out = []
    for row in range(ids.shape[0]):
        first = np.flatnonzero(labels[row] != IGNORE_INDEX)
        end = int(first[0]) + 1 if len(first) else int(mask[row].sum())
        out.append(ids[row, :end].tolist())
    return out

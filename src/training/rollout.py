"""GRPO's rollouts: prompts become groups of sampled completions, scored, cut into micro-batches.

The shared training loop (loop.py) asks a batcher for micro-batches; here the
batcher generates them. Every `steps_per_generation x num_iterations`
micro-batches it takes the next prompts (micro_batch_size x
steps_per_generation / num_generations of them, from a seeded, resumable
prompt order), and:

1. samples num_generations completions per prompt through the backend
   (`backend.sample`, seeded by the run's seed and the generation's index);
2. scores them with the reward functions (rewards/), from the sampled ids
   decoded once for reading, never encoded again: the ids trained are the
   ids sampled;
3. turns rewards into advantages (grpo_loss.group_advantages);
4. shuffles the completions (as TRL) and cuts them into steps_per_generation
   micro-batches, adding old log-probs when the update is off-policy and the
   reference's when grpo.beta > 0.

Its state (prompt position, micro-batches served, and the micro-batches still
to be used from the current generation) goes into each checkpoint, so a
resumed run trains on exactly what the interrupted one would have.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from ..backends.protocol import Sampling
from ..data import Batch, Batcher, IGNORE_INDEX
from ..errors import MudpuppyError
from ..evaluation.heldout import stop_token_ids
from ..rewards import score
from .grpo_loss import RolloutBatch, group_advantages, nanstd

COMPLETIONS = "completions.jsonl"
SAMPLES_SHOWN = 4       # completions of each generation the --tui dashboard shows: one per prompt


class RolloutBatcher:
    def __init__(self, cfg, backend, handle, prompts: list, reward_funcs: list, out: Path, agent=None):
        """`agent` (multiturn.Agent): tools and environments for multi-turn rollouts; None: one turn."""
        g, t = cfg.grpo, cfg.training
        self.cfg, self.g, self.backend, self.handle, self.funcs = cfg, g, backend, handle, reward_funcs
        self.agent = agent
        self.spg = g.steps_per_generation or t.gradient_accumulation_steps
        self.per_generation = t.micro_batch_size * self.spg // g.num_generations      # prompts
        self.off_policy = g.num_iterations > 1 or self.spg > t.gradient_accumulation_steps
        if len(prompts) < self.per_generation:
            raise MudpuppyError(
                f"grpo: {len(prompts)} training prompts, but a generation batch takes {self.per_generation} "
                f"(micro_batch_size {t.micro_batch_size} x steps_per_generation {self.spg} / num_generations "
                f"{g.num_generations}); add prompts or lower micro_batch_size")
        self.prompts = Batcher(prompts, self.per_generation, handle.tokenizer.pad_token_id, t.seed,
                               cfg.data.shuffle, collate_fn=lambda items, pad: items)
        self.weights = np.array([f.spec.weight for f in reward_funcs], dtype=np.float64)
        self.stop_ids = stop_token_ids(handle.tokenizer)
        self.sampling = Sampling(g.temperature, g.top_p, g.top_k, g.min_p)
        self.log_path = out / COMPLETIONS if g.log_completions else None
        self.served = 0                              # micro-batches handed out so far
        self.buffer: list[RolloutBatch] = []
        self.pending: dict[str, float] = {}
        self.pending_samples: list[dict] = []

    # -- what train_loop uses
    @property
    def epoch(self) -> int:
        return self.prompts.epoch

    @property
    def batches_per_epoch(self) -> int:
        """Micro-batches in one pass over the prompts (a last, partial generation batch is skipped)."""
        return len(self.prompts.examples) // self.per_generation * self.spg * self.g.num_iterations

    def next_batch(self) -> RolloutBatch:
        if self.served % self.cycle == 0:
            self.buffer = self.generate(self.served // self.cycle)
        micro = self.buffer[self.served % self.spg]
        self.served += 1
        return micro

    def pop_metrics(self) -> dict[str, float]:
        """The metrics of a generation made during the step that just ran (empty otherwise)."""
        out, self.pending = self.pending, {}
        return out

    def pop_samples(self) -> list[dict]:
        """A few completions of that generation, as {prompt, completion, reward (weighted total)}: texts,
        which metrics.jsonl and the trackers do not take, so they travel apart from pop_metrics."""
        out, self.pending_samples = self.pending_samples, []
        return out

    # -- one generation batch
    def generate(self, index: int) -> list[RolloutBatch]:
        g, tok = self.g, self.handle.tokenizer
        examples = self.prompts.next_batch()
        while len(examples) < self.per_generation:      # an epoch's last, partial batch: skipped, as TRL does
            examples = self.prompts.next_batch()
        started = time.perf_counter()
        repeated = [ex for ex in examples for _ in range(g.num_generations)]
        prompt_ids = [list(map(int, ex.prompt.input_ids)) for ex in repeated]
        seed = generation_seed(self.cfg.training.seed, index)
        fields = [ex.fields for ex in repeated]
        if self.agent is None:
            completions = self.backend.sample(self.handle, prompt_ids, g.max_completion_length, self.stop_ids,
                                              self.sampling, seed=seed)
            masks, messages, environments, exchanges = None, None, None, None
        else:
            def sample(prompts, max_new, round_):
                return self.backend.sample(self.handle, prompts, max_new, self.stop_ids, self.sampling,
                                           seed=seed if round_ == 0 else generation_seed(seed, round_))

            exchanges, environments, prompt_ids = self.agent.run(repeated, prompt_ids, sample)
            completions = [e.ids for e in exchanges]
            masks, messages = [e.sampled for e in exchanges], [e.messages for e in exchanges]
        sampled = time.perf_counter() - started
        texts = tok.batch_decode(completions, skip_special_tokens=True)
        rewards = score_completions(self.funcs, fields, texts, completions, messages, environments)
        adv = group_advantages(rewards, self.weights, g.num_generations, g.scale_rewards)
        truncated = np.array([not ids or ids[-1] not in self.stop_ids for ids in completions])
        trained = ~truncated if g.mask_truncated_completions else np.ones(len(completions), dtype=bool)
        step = self.served // self.cfg.training.gradient_accumulation_steps + 1
        self.log(step, fields, texts, rewards, adv.advantages, messages)
        order = np.random.default_rng([self.cfg.training.seed, index, 1]).permutation(len(completions))
        size = self.cfg.training.micro_batch_size
        counted = [sum(m) for m in masks] if masks is not None else [len(c) for c in completions]
        loss_tokens = sum(n for n, keep in zip(counted, trained) if keep)
        micro = []
        for start in range(0, len(order), size):
            rows = order[start : start + size]
            micro.append(self.rollout_batch([prompt_ids[r] for r in rows], [completions[r] for r in rows],
                                            adv.advantages[rows], trained[rows].tolist(), loss_tokens,
                                            None if masks is None else [masks[r] for r in rows]))
        # time/scoring: rewards, advantages and the old and reference log-probs, as docs/methods.md says.
        self.pending = self.metrics(rewards, adv, counted, truncated, sampled, time.perf_counter() - started)
        if exchanges is not None:
            self.pending.update(tool_metrics(exchanges))
        self.pending_samples = self.samples(fields, texts, rewards)
        return micro

    def rollout_batch(self, prompts, completions, advantages, trained: list[bool], loss_tokens: int,
                      masks: list[list[bool]] | None = None) -> RolloutBatch:
        g = self.g
        batch = completion_batch(prompts, completions, trained, self.handle.tokenizer.pad_token_id, masks)
        rows = np.nonzero(batch.labels != IGNORE_INDEX)[0]
        micro = RolloutBatch(batch, np.asarray(advantages, np.float32), rows, None, None,
                             dapo_count=max(loss_tokens, 1) / self.spg)
        if self.off_policy:
            logps, _ = self.backend.token_logprobs(self.handle, batch, grad=False, temperature=g.temperature)
            micro.old_logps = self.backend.ops.to_numpy(logps).astype(np.float32)
        if g.beta != 0.0:
            ref, _ = self.backend.token_logprobs(self.handle, batch, grad=False, temperature=g.temperature,
                                                 reference=True)
            micro.ref_logps = self.backend.ops.to_numpy(ref).astype(np.float32)
        return micro

    def metrics(self, rewards, adv, lengths, truncated, sampled: float, total: float) -> dict[str, float]:
        """TRL's names for what a generation batch shows (rewards, lengths: the tokens the model sampled,
        tool results left out, as TRL counts them), plus where the time went."""
        lengths = np.asarray(lengths, dtype=np.float64)
        finished = lengths[~truncated]
        out = {"reward": nanmean(adv.rewards), "reward_std": nanstd_or_zero(adv.rewards),
               "frac_reward_zero_std": float(adv.std_is_zero.mean()),
               "completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
               "completions/max_length": float(lengths.max()), "completions/clipped_ratio": float(truncated.mean()),
               "completions/mean_terminated_length": float(finished.mean()) if len(finished) else 0.0,
               "time/generation": round(sampled, 3), "time/scoring": round(total - sampled, 3)}
        for i, f in enumerate(self.funcs):
            out[f"rewards/{f.name}/mean"] = nanmean(rewards[:, i])
            out[f"rewards/{f.name}/std"] = nanstd_or_zero(rewards[:, i])
        return out

    def samples(self, fields, texts, rewards) -> list[dict]:
        """The first completion of each of the first SAMPLES_SHOWN prompts, with its weighted reward."""
        total = np.nansum(rewards * self.weights[None, :], axis=1)
        rows = range(0, len(texts), self.g.num_generations)
        return [{"prompt": fields[i]["prompt"], "completion": texts[i], "reward": float(total[i])}
                for i in list(rows)[:SAMPLES_SHOWN]]

    def log(self, step: int, fields, texts, rewards, advantages, messages=None) -> None:
        """One line per completion; with tools, `turns` holds the exchange turn by turn (the model's
        turns with their calls, and each tool's result)."""
        if self.log_path is None:
            return
        with self.log_path.open("a", encoding="utf-8") as fh:
            for i, text in enumerate(texts):
                row = {"step": step, "prompt": fields[i]["prompt"], "completion": text,
                       "rewards": {f.name: none_if_nan(rewards[i, j]) for j, f in enumerate(self.funcs)},
                       "advantage": round(float(advantages[i]), 6)}
                if messages is not None:
                    row["turns"] = messages[i]
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")

    # -- resume
    def state_dict(self) -> dict:
        return {"prompts": self.prompts.state_dict(), "served": self.served,
                "buffer": [encode_micro(m) for m in self.buffer] if self.served % self.cycle else []}

    def load_state_dict(self, state: dict) -> None:
        self.prompts.load_state_dict(state["prompts"])
        self.served = int(state["served"])
        self.buffer = [decode_micro(m) for m in state["buffer"]]

    @property
    def cycle(self) -> int:
        return self.spg * self.g.num_iterations


def score_completions(funcs: list, fields: list[dict], texts: list[str], ids: list[list[int]],
                      messages: list[list[dict]] | None = None, environments: list | None = None) -> np.ndarray:
    """[completions, functions] rewards, called as TRL calls reward functions: the prompt as the data
    had it, the completion as text (or as an assistant message when the prompt is messages; with
    tools, always the exchange as messages), its ids, every other column by name, and with an
    environment `environments`, each completion's instance."""
    prompts = [f["prompt"] for f in fields]
    if messages is not None:
        shaped = messages
    else:
        shaped = [[{"role": "assistant", "content": t}] if isinstance(p, list) else t for p, t in zip(prompts, texts)]
    columns = {k: [f.get(k) for f in fields] for k in fields[0] if k != "prompt"}
    if environments is not None:
        columns["environments"] = environments
    return score(funcs, prompts, shaped, ids, columns)


def tool_metrics(exchanges: list) -> dict[str, float]:
    """TRL's tools/call_frequency (calls per completion) and tools/failure_frequency (failed share of
    calls), and tools/failures (how many calls failed: raised, timed out, unknown or unreadable)."""
    calls = sum(e.calls for e in exchanges)
    failures = sum(e.failures for e in exchanges)
    return {"tools/call_frequency": calls / max(len(exchanges), 1),
            "tools/failure_frequency": failures / calls if calls else 0.0, "tools/failures": float(failures)}


def generation_seed(seed: int, index: int) -> int:
    """The sampler's seed for generation batch `index`: a function of the two alone."""
    return int(np.random.default_rng([seed, index]).integers(0, 2**62))


def completion_batch(prompts: list[list[int]], completions: list[list[int]], trained: list[bool],
                     pad_id: int, masks: list[list[bool]] | None = None) -> Batch:
    """Prompt + completion per row, right-padded, each completion token the target of the
    position before it (labels aligned as everywhere in data/: label t is the target of input t).
    `masks[row][j]` False: completion token j is context (a tool's result), not the model's: no label."""
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    ids = np.full((len(prompts), width), pad_id, dtype=np.int64)
    labels = np.full((len(prompts), width), IGNORE_INDEX, dtype=np.int64)
    attn = np.zeros((len(prompts), width), dtype=np.int64)
    for row, (p, c, keep) in enumerate(zip(prompts, completions, trained)):
        seq = p + c
        ids[row, : len(seq)] = seq
        attn[row, : len(seq)] = 1
        if keep and c:
            target = np.asarray(c, dtype=np.int64)
            if masks is not None:
                target = np.where(np.asarray(masks[row], dtype=bool), target, IGNORE_INDEX)
            labels[row, len(p) - 1 : len(seq) - 1] = target
    return Batch(ids, labels, attn)


def encode_micro(m: RolloutBatch) -> dict:
    b = m.batch
    arrays = {"input_ids": b.input_ids, "labels": b.labels, "attention_mask": b.attention_mask,
              "advantages": m.advantages, "old_logps": m.old_logps, "ref_logps": m.ref_logps}
    out = {k: (None if v is None else {"dtype": str(v.dtype), "shape": list(v.shape), "values": v.ravel().tolist()})
           for k, v in arrays.items()}
    out["dapo_count"] = m.dapo_count
    return out


def decode_micro(d: dict) -> RolloutBatch:
    def arr(key):
        v = d[key]
        return None if v is None else np.asarray(v["values"], dtype=v["dtype"]).reshape(v["shape"])

    batch = Batch(arr("input_ids"), arr("labels"), arr("attention_mask"))
    rows = np.nonzero(batch.labels != IGNORE_INDEX)[0]
    return RolloutBatch(batch, arr("advantages"), rows, arr("old_logps"), arr("ref_logps"), d["dapo_count"])


def nanmean(x: np.ndarray) -> float:
    x = np.asarray(x, dtype=np.float64)
    return float(x[~np.isnan(x)].mean()) if (~np.isnan(x)).any() else float("nan")


def nanstd_or_zero(x: np.ndarray) -> float:
    """TRL's logged std: the sample std of the non-NaN values, 0 for fewer than two."""
    std = nanstd(x)
    return 0.0 if np.isnan(std) else std


def none_if_nan(v: float) -> float | None:
    return None if np.isnan(v) else round(float(v), 6)

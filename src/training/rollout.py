"""GRPO's rollouts: prompts become groups of sampled completions, scored, cut into micro-batches.

The shared training loop (loop.py) asks a batcher for micro-batches; here the
batcher generates them. Every `steps_per_generation x num_iterations`
micro-batches it takes the next prompts (micro_batch_size x
steps_per_generation / num_generations of them, from a seeded, resumable
prompt order), and:

1. samples num_generations completions per prompt through the backend
   (`backend.sample`), each prompt's group with a seed of its own made from
   the run's seed, the generation's index and the group's place in the
   generation batch;
2. scores them with the reward functions (rewards/), from the sampled ids
   decoded once for reading, never encoded again: the ids trained are the
   ids sampled;
3. turns rewards into advantages (grpo_loss.group_advantages; for RLOO
   rloo.rloo_advantages, the reward less beta x the KL to the reference);
4. shuffles the completions (as TRL) and cuts them into steps_per_generation
   micro-batches, adding old log-probs when the update is off-policy and the
   reference's when grpo.beta > 0.

In a distributed run of N processes micro_batch_size is per process, as
everywhere: a generation batch holds N times the prompts, every rank walks
the same prompt order, and rank r samples and scores the groups of its
contiguous block of prompts (a group never spans ranks), with its own
reward model, tools and environments. The rollouts are then gathered (ids,
rewards, texts: small), so that every rank holds the generation batch one
process would hold, in the same order: advantages (batch-scaled ones too),
metrics and the shuffle are those of one process, and rank r trains on the
r-th part of each of the shuffled micro-batches of N x micro_batch_size
completions. With the loss normalised over every rank's units (the
trainer's all-reduced count) each optimizer step sums the gradient of the
same completions as one process at N x micro_batch_size.

Its state (prompt position, micro-batches served, and the micro-batches still
to be used from the current generation, gathered from every rank) goes into
each checkpoint, so a resumed run trains on exactly what the interrupted one
would have, with any number of processes at the same global batch.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..backends.protocol import Sampling
from ..data import Batch, Batcher, IGNORE_INDEX
from ..errors import MudpuppyError
from ..evaluation.heldout import stop_token_ids
from ..rewards import score
from .grpo_loss import RolloutBatch, group_advantages, nanstd
from .online_dpo import pair_preferences
from .rloo import rloo_advantages

COMPLETIONS = "completions.jsonl"
SAMPLES_SHOWN = 4       # completions of each generation the --tui dashboard shows: one per prompt


class RolloutBatcher:
    def __init__(self, cfg, backend, handle, prompts: list, reward_funcs: list, out: Path, agent=None):
        """`agent` (multiturn.Agent): tools and environments for multi-turn rollouts; None: one turn."""
        g, t = cfg.rollout, cfg.training      # the online method's section: grpo, rloo or online_dpo
        self.rloo = cfg.method == "rloo"     # RLOO's advantages, with the KL in the reward (rloo.py)
        self.pairs = cfg.method == "online_dpo"   # chosen +1 / rejected -1, whole pairs a micro-batch (online_dpo.py)
        self.passes = getattr(g, "num_iterations", 1)
        self.logp_temperature = 1.0 if self.pairs else g.temperature        # TRL's online DPO: logits as they are
        self.cfg, self.g, self.backend, self.handle, self.funcs = cfg, g, backend, handle, reward_funcs
        self.agent = agent
        self.ranks = backend.ranks
        self.spg = g.steps_per_generation or t.gradient_accumulation_steps
        self.per_rank = t.micro_batch_size * self.spg // g.num_generations           # prompts this rank samples
        self.per_generation = self.per_rank * self.ranks.world                         # prompts
        self.off_policy = not self.pairs and (self.passes > 1 or self.spg > t.gradient_accumulation_steps)
        if len(prompts) < self.per_generation:
            procs = f" x {self.ranks.world} processes" if self.ranks.distributed else ""
            raise MudpuppyError(
                f"{cfg.method}: {len(prompts)} training prompts, but a generation batch takes {self.per_generation} "
                f"(micro_batch_size {t.micro_batch_size} x steps_per_generation {self.spg} / num_generations "
                f"{g.num_generations}{procs}); add prompts or lower micro_batch_size")
        self.prompts = Batcher(prompts, self.per_generation, handle.tokenizer.pad_token_id, t.seed,
                               cfg.data.shuffle, collate_fn=lambda items, pad: items)
        self.weights = np.array([f.spec.weight for f in reward_funcs], dtype=np.float64)
        self.stop_ids = stop_token_ids(handle.tokenizer)
        self.sampling = Sampling(g.temperature, g.top_p, g.top_k, g.min_p)
        self.log_path = out / COMPLETIONS if g.log_completions else None
        self.served = 0                              # micro-batches handed out so far
        self.buffer: list[RolloutBatch] = []         # this rank's micro-batches of the current generation
        self.loss_tokens = 0                         # the current generation's loss tokens, every rank's
        self.pending: dict[str, float] = {}
        self.pending_samples: list[dict] = []

    # -- what train_loop uses
    @property
    def epoch(self) -> int:
        return self.prompts.epoch

    @property
    def batches_per_epoch(self) -> int:
        """Micro-batches in one pass over the prompts (a last, partial generation batch is skipped)."""
        return len(self.prompts.examples) // self.per_generation * self.spg * self.passes

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
        g, ranks = self.g, self.ranks
        examples = self.prompts.next_batch()
        while len(examples) < self.per_generation:      # an epoch's last, partial batch: skipped, as TRL does
            examples = self.prompts.next_batch()
        started = time.perf_counter()
        first = ranks.rank * self.per_rank               # this rank's block of prompts: their groups sample here
        local, sampled = self.roll_out(examples[first : first + self.per_rank], index, first)
        # Every rank's rollouts in the generation batch's order: what one process would hold.
        gen = Rollouts.join(ranks.gather(local)) if ranks.distributed else local
        truncated = self.truncated(gen.completions)
        adv = self.advantages(gen, truncated)
        trained = ~truncated if g.mask_truncated_completions else np.ones(len(gen.completions), dtype=bool)
        step = self.served // self.cfg.training.gradient_accumulation_steps + 1
        if ranks.is_main:
            self.log(step, gen.prompts, gen.texts, gen.rewards, adv.advantages, gen.messages)
        order = np.random.default_rng([self.cfg.training.seed, index, 1]).permutation(len(gen.completions) // (
            2 if self.pairs else 1))
        if self.pairs:                               # a pair's two completions stay side by side
            order = (order[:, None] * 2 + np.arange(2)).reshape(-1)
        size, world = self.cfg.training.micro_batch_size, ranks.world
        counted = gen.counted
        self.loss_tokens = int(sum(n for n, keep in zip(counted, trained) if keep))
        micro = []
        for start in range(0, len(order), size * world):
            # This rank's part of the next micro-batch of world x micro_batch_size completions.
            rows = order[start : start + size * world][ranks.rank * size : (ranks.rank + 1) * size]
            micro.append(self.rollout_batch([gen.prompt_ids[r] for r in rows], [gen.completions[r] for r in rows],
                                            adv.advantages[rows], trained[rows].tolist(), self.loss_tokens,
                                            None if gen.masks is None else [gen.masks[r] for r in rows]))
        # time/scoring: rewards, advantages and the old and reference log-probs, as docs/methods.md says.
        self.pending = self.metrics(gen.rewards, adv, counted, truncated, sampled, time.perf_counter() - started)
        if gen.calls is not None:
            self.pending.update(tool_metrics(gen.calls, gen.failures))
        if gen.kl is not None:                       # TRL's RLOO: the token mean of (old logp - ref logp)
            self.pending["kl"] = float(gen.kl.sum() / max(self.loss_tokens, 1))
        self.pending_samples = self.samples(gen.prompts, gen.texts, gen.rewards)
        return micro

    def advantages(self, gen: "Rollouts", truncated: np.ndarray):
        g = self.g
        if self.pairs:
            return pair_preferences(gen.rewards, self.weights, truncated, g.missing_eos_penalty)
        if self.rloo:
            return rloo_advantages(gen.rewards, self.weights, g.num_generations, g.normalize_advantages,
                                   g.reward_clip_range, gen.kl, g.beta)
        return group_advantages(gen.rewards, self.weights, g.num_generations, g.scale_rewards)

    def truncated(self, completions: list[list[int]]) -> np.ndarray:
        """[n] bool: the completion ended without a stop token (cut at max_completion_length)."""
        return np.array([not ids or ids[-1] not in self.stop_ids for ids in completions])

    def sequence_kl(self, prompt_ids, completions, masks) -> np.ndarray:
        """RLOO's KL per completion [n]: the sum over its loss tokens of (logp - ref logp), before any
        update (TRL's old and reference log-probs), in micro_batch_size forwards."""
        g, size, pad = self.g, self.cfg.training.micro_batch_size, self.handle.tokenizer.pad_token_id
        trained = ~self.truncated(completions) if g.mask_truncated_completions else np.ones(len(completions), bool)
        out = []
        for s in range(0, len(completions), size):
            part = slice(s, s + size)
            batch = completion_batch(prompt_ids[part], completions[part], trained[part].tolist(), pad,
                                     None if masks is None else masks[part])
            logps, _ = self.backend.token_logprobs(self.handle, batch, grad=False, temperature=g.temperature)
            ref, _ = self.backend.token_logprobs(self.handle, batch, grad=False, temperature=g.temperature,
                                                 reference=True)
            diff = self.backend.ops.to_numpy(logps).astype(np.float64) - self.backend.ops.to_numpy(ref)
            rows = np.nonzero(batch.labels != IGNORE_INDEX)[0]
            out.append(np.bincount(rows, weights=diff, minlength=batch.input_ids.shape[0]))
        return np.concatenate(out)

    def roll_out(self, examples: list, index: int, first_group: int) -> tuple["Rollouts", float]:
        """This rank's rollouts of `examples` (the groups first_group.. of generation `index`), scored;
        and the seconds sampling took."""
        g, tok = self.g, self.handle.tokenizer
        started = time.perf_counter()
        repeated = [ex for ex in examples for _ in range(g.num_generations)]
        prompt_ids = [list(map(int, ex.prompt.input_ids)) for ex in repeated]
        seeds = [group_seed(self.cfg.training.seed, index, first_group + i)
                 for i in range(len(examples)) for _ in range(g.num_generations)]
        fields = [ex.fields for ex in repeated]
        calls = failures = None
        if self.agent is None:
            completions = self.backend.sample(self.handle, prompt_ids, g.max_completion_length, self.stop_ids,
                                              self.sampling, seed=seeds)
            masks, messages, environments = None, None, None
        else:
            base = generation_seed(self.cfg.training.seed, index)

            def sample(prompts, max_new, round_):
                return self.backend.sample(self.handle, prompts, max_new, self.stop_ids, self.sampling,
                                           seed=seeds if round_ == 0 else turn_seeds(base, round_, prompts))

            exchanges, environments, prompt_ids = self.agent.run(repeated, prompt_ids, sample)
            completions = [e.ids for e in exchanges]
            masks, messages = [e.sampled for e in exchanges], [e.messages for e in exchanges]
            calls, failures = [e.calls for e in exchanges], [e.failures for e in exchanges]
        sampled = time.perf_counter() - started
        texts = tok.batch_decode(completions, skip_special_tokens=True)
        rewards = score_completions(self.funcs, fields, texts, completions, messages, environments)
        kl = self.sequence_kl(prompt_ids, completions, masks) if self.rloo and g.beta != 0.0 else None
        return Rollouts(prompt_ids, completions, masks, rewards, [f["prompt"] for f in fields], texts, messages,
                        calls, failures, kl), sampled

    def rollout_batch(self, prompts, completions, advantages, trained: list[bool], loss_tokens: int,
                      masks: list[list[bool]] | None = None) -> RolloutBatch:
        g = self.g
        batch = completion_batch(prompts, completions, trained, self.handle.tokenizer.pad_token_id, masks)
        rows = np.nonzero(batch.labels != IGNORE_INDEX)[0]
        micro = RolloutBatch(batch, np.asarray(advantages, np.float32), rows, None, None,
                             dapo_count=self.dapo_count(loss_tokens))
        if self.off_policy:
            logps, _ = self.backend.token_logprobs(self.handle, batch, grad=False, temperature=self.logp_temperature)
            micro.old_logps = self.backend.ops.to_numpy(logps).astype(np.float32)
        if g.beta != 0.0 and not self.rloo:         # GRPO's KL is in the loss; RLOO's is in the reward
            ref, _ = self.backend.token_logprobs(self.handle, batch, grad=False, temperature=self.logp_temperature,
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

    def dapo_count(self, loss_tokens: int) -> float:
        """A micro-batch's share of dapo's (cispo's, vespo's) normaliser: the generation batch's loss tokens
        (every rank's) / steps_per_generation, split over the ranks, whose counts the trainer sums."""
        return max(loss_tokens, 1) / (self.spg * self.ranks.world)

    def samples(self, prompts: list, texts, rewards) -> list[dict]:
        """The first completion of each of the first SAMPLES_SHOWN prompts, with its weighted reward."""
        total = np.nansum(rewards * self.weights[None, :], axis=1)
        rows = range(0, len(texts), self.g.num_generations)
        return [{"prompt": prompts[i], "completion": texts[i], "reward": float(total[i])}
                for i in list(rows)[:SAMPLES_SHOWN]]

    def log(self, step: int, prompts: list, texts, rewards, advantages, messages=None) -> None:
        """One line per completion; with tools, `turns` holds the exchange turn by turn (the model's
        turns with their calls, and each tool's result)."""
        if self.log_path is None:
            return
        with self.log_path.open("a", encoding="utf-8") as fh:
            for i, text in enumerate(texts):
                row = {"step": step, "prompt": prompts[i], "completion": text,
                       "rewards": {f.name: none_if_nan(rewards[i, j]) for j, f in enumerate(self.funcs)},
                       "advantage": round(float(advantages[i]), 6)}
                if messages is not None:
                    row["turns"] = messages[i]
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")

    # -- resume
    def state_dict(self) -> dict:
        """The position, and the current generation's micro-batches as one process at the global batch
        would hold them (every rank's parts joined: a collective in a distributed run), so a checkpoint
        resumes with any number of processes."""
        buffer = []
        if self.served % self.cycle:
            parts = self.ranks.gather(self.buffer) if self.ranks.distributed else [self.buffer]
            pad = self.handle.tokenizer.pad_token_id
            buffer = [encode_micro(join_micro([p[j] for p in parts], pad)) for j in range(len(self.buffer))]
        return {"prompts": self.prompts.state_dict(), "served": self.served, "buffer": buffer,
                "loss_tokens": self.loss_tokens}

    def load_state_dict(self, state: dict) -> None:
        self.prompts.load_state_dict(state["prompts"])
        self.served = int(state["served"])
        ranks = self.ranks
        self.buffer = [split_micro(decode_micro(m), ranks.rank, ranks.world) for m in state["buffer"]]
        if "loss_tokens" in state:                   # (checkpoints of one process before it: dapo_count as saved)
            self.loss_tokens = int(state["loss_tokens"])
            for m in self.buffer:
                m.dapo_count = self.dapo_count(self.loss_tokens)

    @property
    def cycle(self) -> int:
        return self.spg * self.passes


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


@dataclass
class Rollouts:
    """A generation batch's scored rollouts, or one rank's share of them: what the other ranks need."""

    prompt_ids: list[list[int]]         # what each completion continues (an environment's observation included)
    completions: list[list[int]]        # every token after the prompt (tool results included)
    masks: list[list[bool]] | None      # with tools: which of them the model sampled
    rewards: np.ndarray                 # [n, functions], NaN where a function returned None
    prompts: list                       # the data's prompt of each (completions.jsonl, the dashboard)
    texts: list[str]
    messages: list | None               # with tools: the exchange as messages
    calls: list[int] | None             # with tools: calls made, and how many of them failed
    failures: list[int] | None
    kl: np.ndarray | None = None        # rloo with beta > 0: each completion's summed (logp - ref logp)

    @property
    def counted(self) -> list[int]:
        """The tokens the model sampled per completion (tool results left out, as TRL counts them)."""
        return [sum(m) for m in self.masks] if self.masks is not None else [len(c) for c in self.completions]

    @staticmethod
    def join(parts: list["Rollouts"]) -> "Rollouts":
        def cat(name):
            values = [getattr(p, name) for p in parts]
            return None if values[0] is None else [v for part in values for v in part]

        return Rollouts(cat("prompt_ids"), cat("completions"), cat("masks"),
                        np.concatenate([p.rewards for p in parts]), cat("prompts"), cat("texts"), cat("messages"),
                        cat("calls"), cat("failures"),
                        None if parts[0].kl is None else np.concatenate([p.kl for p in parts]))


def tool_metrics(calls: list[int], failures: list[int]) -> dict[str, float]:
    """TRL's tools/call_frequency (calls per completion) and tools/failure_frequency (failed share of
    calls), and tools/failures (how many calls failed: raised, timed out, unknown or unreadable);
    `calls` and `failures` per completion."""
    made, failed = sum(calls), sum(failures)
    return {"tools/call_frequency": made / max(len(calls), 1),
            "tools/failure_frequency": failed / made if made else 0.0, "tools/failures": float(failed)}


def generation_seed(seed: int, index: int) -> int:
    """A seed for generation batch `index`: a function of the two alone."""
    return int(np.random.default_rng([seed, index]).integers(0, 2**62))


def group_seed(seed: int, index: int, group: int) -> int:
    """The sampler's seed for the group of the `group`-th prompt of generation batch `index`: a function
    of the three alone, so a group samples the same completions whichever rank samples it and whatever
    else is in that rank's batch (backend.sample draws each seed's rows from a stream of their own)."""
    return int(np.random.default_rng([seed, index, 2, group]).integers(0, 2**62))


def turn_seeds(seed: int, round_: int, inputs: list[list[int]]) -> list[int]:
    """Seeds for round `round_` > 0 of multi-turn rollouts (those still calling tools): from `seed` (the
    generation's), the round and what each rollout continues, its prompt and everything after it. A
    rollout keeps no fixed row across rounds, but what it continues is the same on any rank. Rollouts
    continuing the same ids share a seed, and so draw together as rows of one stream."""
    out = []
    for ids in inputs:
        data = np.asarray([seed, round_, *ids], dtype=np.int64).tobytes()
        out.append(int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 2)
    return out


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


def join_micro(parts: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """The micro-batch whose rows are those of `parts` in order (each rank's share of one micro-batch),
    right-padded to the widest; dapo_count is the parts' summed counts."""
    if len(parts) == 1:
        return parts[0]
    width = max(p.batch.input_ids.shape[1] for p in parts)

    def padded(name, value):
        arrays = [getattr(p.batch, name) for p in parts]
        return np.concatenate([np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=value) for a in arrays])

    batch = Batch(padded("input_ids", pad_id), padded("labels", IGNORE_INDEX), padded("attention_mask", 0))
    rows = np.nonzero(batch.labels != IGNORE_INDEX)[0]

    def tokens(name):
        values = [getattr(p, name) for p in parts]
        return None if values[0] is None else np.concatenate(values)

    return RolloutBatch(batch, np.concatenate([p.advantages for p in parts]), rows, tokens("old_logps"),
                        tokens("ref_logps"), sum(p.dapo_count for p in parts))


def split_micro(m: RolloutBatch, rank: int, world: int) -> RolloutBatch:
    """Rank `rank`'s contiguous share of a micro-batch of `world` ranks' rows, cut to its own width (as the
    rank made it); dapo_count split evenly."""
    if world == 1:
        return m
    n = m.size
    if n % world:
        raise MudpuppyError(f"cannot resume: the checkpoint's micro-batches hold {n} completions, which do not "
                            f"split over {world} processes; resume with a number of processes that divides {n} "
                            "(at the same micro_batch_size x processes)")
    lo, hi = rank * n // world, (rank + 1) * n // world
    b = m.batch
    width = int(b.attention_mask[lo:hi].sum(axis=1).max())
    batch = Batch(b.input_ids[lo:hi, :width], b.labels[lo:hi, :width], b.attention_mask[lo:hi, :width])
    counts = np.bincount(m.rows, minlength=n)
    first, last = int(counts[:lo].sum()), int(counts[:hi].sum())

    def tokens(values):
        return None if values is None else values[first:last]

    return RolloutBatch(batch, m.advantages[lo:hi], np.nonzero(batch.labels != IGNORE_INDEX)[0],
                        tokens(m.old_logps), tokens(m.ref_logps), m.dapo_count / world)


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

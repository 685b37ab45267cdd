"""GRPO: online reinforcement learning with group-relative advantages, written once for every backend.

Supports: rl data ({prompt} as text or messages, plus any columns the reward
functions read); built-in rewards, the user's Python functions and reward
models trained with `method: rm`, weighted; TRL 1.16's loss types (grpo,
bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo), reward scaling (group,
batch, none), clipping with epsilon / epsilon_high / delta, token- or
sequence-level importance sampling (GSPO), the k3 KL to the reference through the disabled adapter
(beta > 0), several optimisation passes per generation (num_iterations)
and generation batches spanning several optimizer steps
(steps_per_generation); LoRA, DoRA, QLoRA and full fine-tuning (beta 0);
everything the shared loop offers (checkpoints with exact resume, Ctrl-C,
on_nan, early stopping on held-out reward).

Several processes (`--nproc N`, torchrun, mlx.launch; distributed.strategy ddp):
each rank samples and scores its block of each generation batch's prompts, the
rollouts are gathered, and N processes at micro_batch_size b train as one
process at N x b (rollout.py says how).

Multi-turn rollouts with tools and environments (TRL's tools and
environment_factory): agent.py sets them up, multiturn.py runs the turns,
tools.py reads and runs the calls, environments.py holds the per-rollout state.

Does not support: vLLM or any separate inference server, entropy masking
or bonuses, a reference other than the starting weights, FSDP.

The four pieces, each readable on its own: sampling through the backend
(rollout.py), scoring (rewards/), advantages in numpy and the loss through
ArrayOps (grpo_loss.py). This file is setup, loop and save.

`method: rloo` and `method: online_dpo` run this same recipe with their own
advantages and loss (rloo.py, online_dpo.py) in place of GRPO's, and their own
config sections (`rloo:`, `online_dpo:`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from ..backends.decoding import context_length
from ..data import load_data, prepare_data
from ..evaluation import EvalResult
from ..evaluation.heldout import stop_token_ids
from ..monitor.metrics import METRICS
from ..rewards import check_columns, load_reward_functions, parse_reward_specs
from .agent import build_agent, environment_reward, load_agent, offer_tools, schemas
from .grpo_loss import GrpoObjective
from .loop import save_trained, train_loop
from .results import RunResult
from .reward_models import reward_model_function
from .online_dpo import OnlineDpoObjective
from .rloo import RlooObjective
from .rollout import COMPLETIONS, RolloutBatcher, score_completions
from .session import start_run


def run_grpo(cfg, backend, overwrite: bool = False, echo=print, callbacks=()) -> RunResult:
    started = time.perf_counter()
    g = cfg.rollout                       # grpo's section, or rloo's
    # -- setup: data and reward-function problems surface before the policy loads or anything is written
    loaded = load_data(cfg, "grpo")
    specs = parse_reward_specs(g.reward_funcs, g.reward_weights) if g.reward_funcs else []
    funcs = load_reward_functions(specs, cfg.source_dir, reward_model=lambda spec: reward_model_function(
        backend, spec, cfg.source_dir))
    check_columns(funcs, data_columns(loaded), loaded.train[0].name)
    tools, environments = load_agent(cfg)                     # tools and environments import before the model
    funcs += environment_reward(environments, funcs)
    offer_tools(loaded, schemas(tools, environments))
    run = start_run(cfg, backend, overwrite, echo, started, callbacks)   # output_dir locked, model loaded
    handle, out = run.handle, run.out
    data = prepare_data(cfg, handle.tokenizer, loaded, method="grpo", ranks=backend.ranks)
    agent = build_agent(cfg, handle.tokenizer, loaded, data.report, tools, environments,
                        stop_token_ids(handle.tokenizer), context_length(handle))
    run.take_output_dir()                                      # model and data loaded: now the old run goes
    rep = data.report
    echo(f"{method_line(cfg)}, {g.num_generations} completions a prompt, beta {g.beta}): {rep.train_examples} "
         f"prompts / {rep.val_examples} held-out; {rep.truncated} prompts truncated to data.sequence_len; "
         f"rewards: {', '.join(f'{f.name} x{f.spec.weight:g}' for f in funcs)}")
    if agent is not None:
        offered = [s["function"]["name"] for s in schemas(tools, environments)]
        echo(f"tools: {', '.join(offered) or 'none'} ({agent.loop.fmt} format"
             f"{', an environment per rollout' if environments is not None else ''}; up to "
             f"{g.max_tool_calling_iterations or 'unlimited'} rounds of calls, {g.tool_timeout:g} s a call)")

    run.attach_adapter()
    measure = held_out_reward(cfg, backend, handle, data.val, funcs, agent) if data.val else None
    run.measure_before(measure)
    trainer = backend.create_trainer(handle, cfg.training)    # the runtime's optimizer step (trainer.py)
    rollouts = RolloutBatcher(cfg, backend, handle, data.train, funcs, out, agent)
    steps = run.restore(trainer, rollouts)       # a resumed run: weights, optimizer, RNG, data position
    if run.resume_from is not None and backend.ranks.is_main:     # the one process that writes it
        truncate_completions(out / COMPLETIONS, run.state.step)

    # -- loop (loop.train_loop): the rollouts sample each step's batches, the objective is GRPO's loss
    evaluate = (lambda: measure().for_loop()) if measure is not None else None
    stopped_early = train_loop(cfg, run.state, steps, trainer, rollouts, run.checkpoints(trainer, rollouts),
                               run.callbacks(), evaluate=evaluate, objective=objective(cfg, backend), echo=echo)

    # -- save, then evaluate what was saved
    save_trained(cfg, backend, handle, out)
    result = run.result(stopped_early, trainer)
    result.after = run.measure_after(measure, count=False)
    rewards = step_rewards(out) if backend.ranks.is_main else []      # rank 0 wrote metrics.jsonl
    return run.finish(result, rep.train_examples, rep.val_examples,
                      first_reward=rewards[0] if rewards else None, final_reward=rewards[-1] if rewards else None)


def method_line(cfg) -> str:
    """How the run's first line names the objective: `grpo (dapo`, `rloo (leave-one-out`, `online_dpo (sigmoid`."""
    return {"grpo": lambda: f"grpo ({cfg.grpo.loss_type}", "rloo": lambda: "rloo (leave-one-out",
            "online_dpo": lambda: f"online_dpo ({cfg.online_dpo.loss_type}"}[cfg.method]()


def objective(cfg, backend):
    """The loss the loop trains on: GRPO's, RLOO's or online DPO's, over the same rollouts."""
    kinds = {"grpo": GrpoObjective, "rloo": RlooObjective, "online_dpo": OnlineDpoObjective}
    return kinds[cfg.method](backend, cfg.rollout)


def data_columns(loaded) -> set[str]:
    """Columns every training record has (what a built-in reward may read), prompt excluded."""
    sets = [set(rec.data) for ds in loaded.train for rec in ds.records]
    return set.intersection(*sets) - {"prompt"} if sets else set()


def held_out_reward(cfg, backend, handle, prompts: list, funcs: list, agent=None):
    """The weighted reward of greedy completions of the held-out prompts (higher is better; the
    loop's early stopping watches its negative); with tools, greedy multi-turn rollouts."""
    g, tok = cfg.rollout, handle.tokenizer
    chosen = prompts[: cfg.eval.max_samples or None]
    stop = stop_token_ids(tok)
    weights = np.array([f.spec.weight for f in funcs])

    end_of_turn = tok.eos_token_id if tok.eos_token_id in stop else min(stop)

    def greedy_turns(prompts, max_new, _round):
        # generate() drops the stop token it ended on; a turn followed by tool results must keep
        # it, as a sampled turn does (the results' template glue starts after it).
        return [ids + [end_of_turn] if len(ids) < max_new else ids
                for ids in backend.generate(handle, prompts, max_new, stop)]

    def evaluate() -> EvalResult:
        # In a distributed run rank r takes eval batches r, r+N, ... (the batches one process makes) and
        # scores them; the rewards are gathered, so every rank reaches the same value (early stopping).
        ranks = backend.ranks
        starts = list(range(0, len(chosen), cfg.eval.batch_size))[ranks.rank :: ranks.world]
        mine = [ex for start in starts for ex in chosen[start : start + cfg.eval.batch_size]]
        ids, messages, environments = [], None if agent is None else [], None if agent is None else []
        for start in starts:
            examples = chosen[start : start + cfg.eval.batch_size]
            part = [list(map(int, ex.prompt.input_ids)) for ex in examples]
            if agent is None:
                ids += backend.generate(handle, part, g.max_completion_length, stop)
                continue
            exchanges, envs, _ = agent.run(examples, part, greedy_turns)
            ids += [e.ids for e in exchanges]
            messages += [e.messages for e in exchanges]
            environments = None if envs is None else environments + list(envs)
        texts = tok.batch_decode(ids, skip_special_tokens=True)
        r = (score_completions(funcs, [ex.fields for ex in mine], texts, ids, messages, environments) if mine
             else np.zeros((0, len(funcs))))
        if ranks.distributed:                   # back in the order of `chosen`, batch by batch
            size, parts = cfg.eval.batch_size, ranks.gather(r)
            pieces = {start: part[i * size : (i + 1) * size]
                      for rank, part in enumerate(parts)
                      for i, start in enumerate(range(rank * size, len(chosen), ranks.world * size))}
            r = np.concatenate([pieces[start] for start in sorted(pieces)])
        total = np.nansum(r * weights[None, :], axis=1)
        return EvalResult(reward=float(total.mean()), samples=len(chosen),
                          rewards={f.name: float(np.nanmean(r[:, i])) for i, f in enumerate(funcs)
                                   if not np.isnan(r[:, i]).all()})

    return evaluate


def truncate_completions(path: Path, step: int) -> None:
    """Keep the samples of steps up to `step`: a resumed run writes the later ones again."""
    if not path.exists():
        return
    kept = [line for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


def step_rewards(out: Path) -> list[float]:
    """The mean reward of each generation, from metrics.jsonl."""
    path = out / METRICS
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r["reward"] for r in rows if r.get("reward") is not None]

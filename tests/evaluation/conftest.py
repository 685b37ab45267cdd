"""Two short LoRA runs of the tiny model, shared by the eval tests, and an independent oracle:
plain transformers + PEFT, the chat template applied by hand."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from mudpuppy.cli import main

from ..conftest import QUICKSTART_DATA, tiny_run_config

VAL = QUICKSTART_DATA / "smart_home_val.jsonl"
PAIRS = QUICKSTART_DATA / "smart_home_pref_val.jsonl"


@pytest.fixture(scope="module")
def tiny_runs(tiny_model_dir, tmp_path_factory) -> list[Path]:
    """run-a and run-b: the tiny config for 4 steps, two seeds and learning rates."""
    from mudpuppy import create_backend, load_config, run

    root = tmp_path_factory.mktemp("eval-runs")
    for name, seed, lr in (("run-a", 3, 5e-3), ("run-b", 5, 2e-2)):
        cfg = tiny_run_config(tiny_model_dir, root / name)
        cfg["training"].update(seed=seed, max_steps=4, learning_rate=lr)
        cfg["eval"] = {"before_training": False, "after_training": False}
        cfg["data"]["cache"] = False
        run(load_config(cfg), create_backend("cpu"), echo=lambda *_a, **_k: None)
    return [root / "run-a", root / "run-b"]


@pytest.fixture(scope="module")
def adapter_copy(tiny_runs, tmp_path_factory) -> Path:
    """run-b's adapter alone (no config.yaml, no tokenizer): an adapter directory target."""
    out = tmp_path_factory.mktemp("adapter") / "adapter-b"
    out.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(tiny_runs[1] / name, out / name)
    return out


def mudpuppy_eval(*args) -> object:
    return CliRunner().invoke(main, ["eval", *map(str, args)])


def read_eval(out: Path) -> dict:
    return json.loads((out / "eval.json").read_text())


def records(path: Path, n: int) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()[:n]]


class Oracle:
    """Summed log-probs of an assistant answer, with transformers and PEFT only."""

    def __init__(self, model_dir: Path, adapter_dir: Path | None = None):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(str(model_dir))
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        if adapter_dir is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(adapter_dir))
        self.model = model.eval()

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def answer_logprob(self, messages: list[dict], answer: str) -> tuple[float, int]:
        """(sum of log p, tokens) over the answer and the <|im_end|> that closes it: chatml's trained tokens."""
        prompt = self.prompt_ids(messages)
        target = self.tok(answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
        ids = self.torch.tensor([prompt + target])
        with self.torch.no_grad():
            logps = self.torch.log_softmax(self.model(input_ids=ids).logits[0].double(), dim=-1)
        rows = self.torch.arange(len(prompt) - 1, ids.shape[1] - 1)
        return float(logps[rows, ids[0, rows + 1]].sum()), len(target)

    def generate(self, messages: list[dict], max_new_tokens: int) -> str:
        ids = self.torch.tensor([self.prompt_ids(messages)])
        stop = self.tok.convert_tokens_to_ids("<|im_end|>")
        with self.torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=self.torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=max_new_tokens, eos_token_id=[stop],
                                      pad_token_id=self.tok.pad_token_id)
        new = out[0, ids.shape[1]:].tolist()
        new = new[: new.index(stop)] if stop in new else new
        return self.tok.decode(new, skip_special_tokens=True)


@pytest.fixture(scope="session")
def random_adapter(tiny_model_dir, tmp_path_factory) -> Path:
    """A LoRA adapter on the tiny model with random (non-zero) B matrices, so it changes every output;
    saved by PEFT alone: an adapter directory target, no training needed."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    out = tmp_path_factory.mktemp("random-adapter") / "adapter"
    model.save_pretrained(str(out))
    return out

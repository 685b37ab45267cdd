"""The model card (README.md) every export writes: which base (its Hub id, in the front matter the Hub
reads), where the weights the fine-tune trained on truly came from, what the export holds and how to
load it with the library it is for (transformers, llama.cpp, Ollama, mlx-lm).

`mudpuppy merge` and `merge: true` write the same card for their merged model (training/merge.py).
The MLX export replaces the card mlx_lm.convert leaves, which is front matter alone and names the
scratch directory of the merge as its base.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from ..backends.provenance import describe_provenance

CARD = "README.md"
LIBRARIES = {"merged": "transformers", "gguf": "gguf", "ollama": "gguf", "mlx": "mlx", "peft": "peft"}


def hub_link(hub_id: str) -> str:
    return f"[{hub_id}](https://huggingface.co/{hub_id})"


def what_it_holds(fmt: str, record: dict) -> str:
    if fmt == "peft":
        peft = record.get("peft") or {}
        base = (f", with the base it trained on in `{peft['base']}/` ({peft.get('dtype')}: the 4-bit base LoftQ's "
                f"{peft.get('loftq_iter')} iterations left, dequantized; the adapter belongs on it, not on the "
                "original checkpoint)") if peft.get("base") else ""
        return f"a LoRA adapter for PEFT (and mlx-lm, in `mlx/`){base}"
    if fmt == "merged":
        return f"plain {record.get('dtype')} safetensors for transformers"
    if fmt in ("gguf", "ollama"):
        gguf = record.get("gguf") or {}
        held = f"the llama.cpp GGUF file `{gguf.get('file')}` ({gguf.get('quant')})"
        return held + (" with an Ollama `Modelfile` (its chat template, system prompt and stop words)"
                       if fmt == "ollama" else "")
    mlx = record.get("mlx") or {}
    quant = mlx.get("quantization") or {}
    bits = f", quantized to {quant.get('bits')} bits (groups of {quant.get('group_size')})" if quant else ""
    return f"an mlx-lm model directory ({mlx.get('dtype')}{bits})"


def training_line(src, fmt: str = "merged") -> str | None:
    """What was trained on the base, as the source says; None for a model exported as it is."""
    cfg = src.cfg
    merged = ", merged into the base" if fmt != "peft" else ""
    if src.kind == "run":
        adapter = cfg.adapter.type
        how = f"a {adapter} adapter{merged}" if adapter != "none" else "full fine-tuning"
        return f"Fine-tuned with mudpuppy ({cfg.method}, {how}); the run is `{src.given}`."
    if src.kind == "adapter":
        return f"The {cfg.adapter.type} adapter `{src.given}`{merged}."
    if src.finetune:
        return f"A fine-tune ({src.finetune}) exported earlier by mudpuppy, written again in this format."
    return None


def usage(fmt: str, name: str, record: dict) -> list[str]:
    if fmt == "peft":
        base = (record.get("peft") or {}).get("base_model_name_or_path")
        return ["```python", "from peft import AutoPeftModelForCausalLM", "",
                f'model = AutoPeftModelForCausalLM.from_pretrained("{name}")   # loads its base, {base}', "```", "",
                "mlx-lm: `mlx_lm.generate --model BASE --adapter-path " f'{name}/mlx --prompt "Hello"`, BASE {base}.']
    if fmt == "merged":
        return ["```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                f'model = AutoModelForCausalLM.from_pretrained("{name}")',
                f'tokenizer = AutoTokenizer.from_pretrained("{name}")',
                'messages = [{"role": "user", "content": "Hello"}]',
                "inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, "
                'return_tensors="pt")',
                "print(tokenizer.decode(model.generate(**inputs, max_new_tokens=64)[0]))", "```"]
    if fmt in ("gguf", "ollama"):
        file = (record.get("gguf") or {}).get("file")
        lines = []
        if fmt == "ollama":
            lines += ["```sh", f"cd {name}", f"ollama create {name} -f Modelfile", f"ollama run {name}", "```", "",
                      "Or with llama.cpp alone:", ""]
        return lines + ["```sh", f"llama-cli -m {name}/{file} -cnv", "```", "", "```python",
                        "from llama_cpp import Llama", "",
                        f'llm = Llama(model_path="{name}/{file}")',
                        'print(llm.create_chat_completion(messages=[{"role": "user", "content": "Hello"}]))', "```"]
    return ["```python", "from mlx_lm import generate, load", "",
            f'model, tokenizer = load("{name}")',
            'prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], '
            "add_generation_prompt=True)",
            "print(generate(model, tokenizer, prompt=prompt, max_tokens=128))", "```", "",
            "or from the shell:", "", "```sh", f'mlx_lm.generate --model {name} --prompt "Hello"', "```"]


def export_card(out: Path, fmt: str, src, record: dict, verb: str = "export") -> str:
    """README.md for the export of `src` (export.pipeline's ExportSource) as `fmt` into `out`; `record` is
    what export.json records (the format's own details); `verb` the command that wrote it (export, merge)."""
    base = src.base or {}
    hub_id = base.get("hub_id")
    finetuned = src.kind in ("run", "adapter") or bool(src.finetune)
    quantized = (fmt in ("gguf", "ollama") and (record.get("gguf") or {}).get("quant") not in ("f32", "f16", "bf16")
                 or fmt == "mlx" and bool((record.get("mlx") or {}).get("quantization")))
    front: dict = {}
    if hub_id:
        front["base_model"] = hub_id
        relation = "finetune" if finetuned else "quantized" if quantized else None
        if relation:
            front["base_model_relation"] = relation
    tags = ["mudpuppy", fmt] + (["gguf"] if fmt == "ollama" else [])
    if src.kind == "run":
        tags.append(src.cfg.method)
    front.update(library_name=LIBRARIES[fmt], pipeline_tag="text-generation", tags=tags)
    name = out.name
    named = hub_link(hub_id) if hub_id else f"`{base.get('given') or src.given}`"
    held = what_it_holds(fmt, record)
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "", f"# {name}", "",
             f"{held[0].upper()}{held[1:]}, written by `mudpuppy {verb}` from `{src.given}` ({src.describe()}).", "",
             "## Base model", "", f"Base: {named}.", ""]
    trained = training_line(src, fmt)
    provenance = describe_provenance(base, trained=trained is not None)
    if provenance:
        lines += [provenance, ""]
    where = "in the GGUF metadata" if fmt in ("gguf", "ollama") else "in the tokenizer files"
    if trained:
        lines += ["## What was trained", "", trained, "",
                  f"The chat template it was trained with travels with it, {where}.", ""]
    else:
        lines += [f"Exported as it is (no adapter, no training); its chat template travels with it, {where}.", ""]
    lines += ["## Use", "", *usage(fmt, name, record), "",
              "`export.json` beside this card records how the export was made."]
    return "\n".join(lines) + "\n"

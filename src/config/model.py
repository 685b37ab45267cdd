"""The `model` and `adapter` sections: which base loads, and what trains on top of it."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from .base import _Strict

_PISSA_NITER = re.compile(r"pissa_niter_[1-9][0-9]*")
EVA_RHO = 2.0          # PEFT's EvaConfig.rho


class ModelConfig(_Strict):
    base_model: str = Field(min_length=1, description="HF directory, hub id, .gguf file, or alias")
    tokenizer: str | None = Field(None, description="defaults to base_model")
    revision: str | None = None
    trust_remote_code: bool = False
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="storage dtype of the frozen base: auto = the device's compute dtype (bf16, or fp16 on "
                            "GPUs without bf16; fp32 where neither is native), fp32 for weights that train in full")
    # Vision-language models (docs/data.md#images): chat records with images, AutoModelForImageTextToText.
    vision: Literal["auto"] | bool = Field(
        "auto", description="a vision-language model with its processor; auto: when its config.json has a vision_config")
    freeze_vision: bool = Field(
        True, description="vision-language models: the vision tower stays frozen and LoRA adapts the language "
                          "model only; false trains the vision tower too (in full, or with LoRA on its linears)")
    router_aux_loss_coef: float | None = Field(
        None, ge=0.0, description="mixture-of-experts: weight of the router's load-balancing loss in every training "
                                  "objective; null keeps the model's config (on only where it sets "
                                  "output_router_logits), 0 turns it off; refused for a model without a router")


class AdapterConfig(_Strict):
    type: Literal["none", "lora", "dora", "qlora"] = "lora"
    r: int = Field(8, gt=0, le=4096)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    rslora: bool = False
    train_router: bool = Field(
        False, description="mixture-of-experts: the router (gate) of each expert layer trains in full, saved with the "
                           "adapter; false keeps it frozen")
    quant_backend: Literal["int4", "mxfp4"] = Field(
        "int4", description="qlora: 4-bit format of the frozen base (int4 group-wise, or OCP MXFP4 blocks of 32)")
    quant_group_size: int | None = Field(
        64, gt=0, description="qlora int4: values per scale (even); null for one scale per row")
    init_from: str | None = Field(
        None, description="start from this adapter's weights (a PEFT or mlx-lm adapter directory of the same "
                          "type, r and target modules) instead of a fresh initialisation; curricula set it per stage")
    init: str = Field(
        "default", description="LoRA's starting weights (PEFT's init_lora_weights): default (A kaiming-uniform, B "
                               "zero), gaussian (A normal, std 1/r), pissa (A, B the top-r singular triplets of each "
                               "weight, the base their residual), pissa_niter_N (the same by N-iteration randomized "
                               "SVD), olora (A, B from each weight's QR), eva (A the top right-singular vectors of "
                               "each layer's inputs over the training data, B zero; PEFT's EVA), loftq (qlora only: "
                               "scale * B @ A the rank-r SVD of each weight's 4-bit quantization error W - Q, the "
                               "4-bit base unchanged; PEFT's replace_lora_weights_loftq); pissa and olora "
                               "save as a plain LoRA of rank 2r on the original base")
    loftq_iter: int = Field(
        1, description="init loftq: LoftQ's alternating iterations (PEFT's LoftQConfig.loftq_iter): each after the "
                       "first quantizes W minus the previous rank-r correction again, so above 1 the 4-bit base "
                       "itself changes; 1 keeps the base as quantized")
    eva_rho: float | None = Field(
        None, ge=1.0, description="init eva: EVA's rank redistribution (PEFT's EvaConfig.rho, default 2): a layer "
                                  "may take up to r * rho ranks, by explained variance, within the budget of r a "
                                  "layer; 1 keeps r everywhere")

    @model_validator(mode="after")
    def _quant_options_fit(self):
        if self.quant_backend == "mxfp4" and "quant_group_size" in self.model_fields_set:
            raise ValueError("quant_group_size does not apply to mxfp4, whose blocks are always 32 values")
        if self.quant_group_size is not None and self.quant_group_size % 2:
            raise ValueError("quant_group_size must be even (two 4-bit values share a byte)")
        return self

    @field_validator("loftq_iter", mode="before")
    @classmethod
    def _whole_iterations(cls, v):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"loftq_iter is LoftQ's number of alternating iterations, an integer >= 1 (got {v!r})")
        return v

    @field_validator("init")
    @classmethod
    def _known_init(cls, v):
        if v not in ("default", "gaussian", "pissa", "olora", "eva", "loftq") and not _PISSA_NITER.fullmatch(v):
            raise ValueError(f"unknown LoRA initialisation {v!r}; use default, gaussian, pissa, pissa_niter_N "
                             "(N iterations, e.g. pissa_niter_4), olora, eva or loftq")
        return v

    @model_validator(mode="after")
    def _init_fits_type(self):
        if "loftq_iter" in self.model_fields_set and self.loftq_iter != 1 and self.init != "loftq":
            raise ValueError(f"loftq_iter is LoftQ's number of iterations and applies to init loftq (this adapter "
                             f"has init {self.init}); remove it or set init: loftq")
        if self.eva_rho is not None and self.init != "eva":
            raise ValueError(f"eva_rho is EVA's rank redistribution and applies to init eva (this adapter has "
                             f"init {self.init}); remove it or set init: eva")
        if self.init == "eva" and self.rslora and self.rho != 1.0:
            raise ValueError("init eva with rslora: EVA's redistributed ranks would each need their own rsLoRA "
                             "scale (alpha / sqrt(rank)), which one saved LoRA cannot carry; set eva_rho: 1 or "
                             "rslora: false")
        if self.init in ("default", "gaussian"):
            return self
        if self.init == "loftq":
            if self.type != "qlora":
                raise ValueError(f"adapter.init loftq sets A, B to the low-rank part of each weight's 4-bit "
                                 f"quantization error, and adapter.type {self.type} quantizes nothing; use "
                                 "adapter.type qlora")
        elif self.type != "lora":
            what = ("computes A from each layer's inputs on the unquantized base" if self.init == "eva" else
                    "moves part of each base weight into the adapter, which needs a plain LoRA on unquantized weights")
            raise ValueError(f"init {self.init} {what}; adapter.type {self.type} cannot take it (use lora)")
        if self.init_from:
            raise ValueError(f"init {self.init} and init_from both set the adapter's starting weights; keep one")
        return self

    @property
    def rho(self) -> float:
        """EVA's rank redistribution: eva_rho, or PEFT's default."""
        return EVA_RHO if self.eva_rho is None else self.eva_rho

    @field_validator("target_modules")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("give at least one module name, or 'all-linear'")
        return v


def residual_reference_problem(adapter: AdapterConfig, key: str, fix: str) -> str | None:
    """A reference model taken as the base with the adapter switched off is, after PiSSA or OLoRA, the
    residual: not the model the run started from. `key` and `fix` say what to change instead."""
    if adapter.init in ("default", "gaussian", "eva", "loftq"):
        return None
    return (f"{key}: the reference is the base with the adapter off, which after adapter.init {adapter.init} "
            f"is only the residual of each weight; {fix}")


def eva_method_problem(adapter: AdapterConfig, method: str) -> str | None:
    """EVA decomposes the layer inputs of SFT's training batches; other methods' data does not reach it."""
    if adapter.init == "eva" and method != "sft":
        return (f"adapter.init eva: EVA computes A from the layer inputs of the SFT training batches, and method "
                f"{method} trains on other data; use it in an SFT run (a curriculum's SFT stage), or another init")
    return None

"""The shape of a model's KV cache: layers, KV heads, head size, and the bytes one token costs.

KV bytes per token are :func:`kvdiag.pool.kv_bytes.kv_bytes_per_token` (2 x layers x kv_heads x
head_dim x bytes per element).

Built-in shapes, with where their numbers come from:

- ``gpt3-175b``: GPT-3 175B as published (Brown et al. 2020, "Language Models are Few-Shot
  Learners", table 2.1): 96 layers, d_model 12288, 96 heads of 128, multi-head attention.
- ``llama3-8b``: Meta-Llama-3-8B's config.json on the Hugging Face hub: 32 layers, 32 query
  heads, 8 KV heads, head_dim 128 (hidden 4096 / 32 heads).
- ``llama3-70b``: Meta-Llama-3-70B's config.json: 80 layers, 64 query heads, 8 KV heads,
  head_dim 128 (hidden 8192 / 64 heads).
- ``smollm2-135m``: SmolLM2-135M-Instruct's config.json (the model kvdiag fetches and embeds,
  :mod:`kvdiag.demo.smollm`): 30 layers, 9 query heads, 3 KV heads, head_dim 64.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from kvdiag.pool import kv_bytes as kv_shape
from kvdiag.pool.kv_bytes import DTYPE_BYTES, ModelConfigError, element_bytes

__all__ = ["DTYPE_BYTES", "ModelConfigError", "element_bytes", "ModelShape", "BUILTIN_MODELS",
           "kv_bytes_per_token", "from_hf_config", "resolve_model", "shape_from_pool"]


@dataclass(frozen=True)
class ModelShape:
    """What sizes a model's KV cache. ``source``: where the numbers come from."""

    name: str
    num_layers: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    source: str
    dtype: str = "fp16"  # the dtype the model ships in; the planner's --dtype overrides it

    @property
    def attention(self) -> str:
        """MHA (as many KV heads as query heads), MQA (one KV head) or GQA (in between);
        "unknown" when the query heads are not known (0)."""
        if self.num_query_heads == 0:
            return "query heads unknown"
        if self.num_kv_heads == self.num_query_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"


BUILTIN_MODELS: dict[str, ModelShape] = {
    "gpt3-175b": ModelShape("gpt3-175b", 96, 96, 96, 128,
                            "GPT-3 175B, Brown et al. 2020 table 2.1 (d_model 12288 = 96 x 128)"),
    "llama3-8b": ModelShape("llama3-8b", 32, 32, 8, 128,
                            "meta-llama/Meta-Llama-3-8B config.json", dtype="bf16"),
    "llama3-70b": ModelShape("llama3-70b", 80, 64, 8, 128,
                             "meta-llama/Meta-Llama-3-70B config.json", dtype="bf16"),
    "smollm2-135m": ModelShape("smollm2-135m", 30, 9, 3, 64,
                               "HuggingFaceTB/SmolLM2-135M-Instruct config.json (kvdiag's "
                               "embedded model)", dtype="fp32"),
}


def kv_bytes_per_token(model: ModelShape, dtype: str) -> int:
    """KV bytes of one token of ``model`` in ``dtype`` (:func:`kvdiag.pool.kv_bytes.kv_bytes_per_token`)."""
    return kv_shape.kv_bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, dtype)


def _positive_int(config: dict, key: str, where: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelConfigError(f"{where}: {key}: expected a positive integer, got {value!r}")
    return value


_DTYPE_NAMES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def from_hf_config(path: str | Path) -> ModelShape:
    """The KV shape in a Hugging Face ``config.json`` (a file, or a folder holding one):
    ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads`` (absent: MHA) and
    ``head_dim`` (absent: ``hidden_size / num_attention_heads``). GPT-2-style names (``n_layer``,
    ``n_head``, ``n_embd``) are read too; a ``text_config`` (multimodal) is used when present."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ModelConfigError(f"{path}: expected a readable config.json ({exc.strerror})") from None
    except (ValueError, RecursionError) as exc:
        raise ModelConfigError(f"{path}: expected JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ModelConfigError(f"{path}: expected a JSON object")
    if isinstance(config.get("text_config"), dict):
        config = {**config, **config["text_config"]}
    aliases = {"n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
               "n_embd": "hidden_size"}
    config = {**{new: config[old] for old, new in aliases.items() if old in config}, **config}
    where = str(path)
    layers = _positive_int(config, "num_hidden_layers", where)
    heads = _positive_int(config, "num_attention_heads", where)
    kv_heads = (_positive_int(config, "num_key_value_heads", where)
                if config.get("num_key_value_heads") is not None else heads)
    if config.get("head_dim") is not None:
        head_dim = _positive_int(config, "head_dim", where)
    else:
        hidden = _positive_int(config, "hidden_size", where)
        if hidden % heads:
            raise ModelConfigError(f"{where}: hidden_size {hidden} is not a multiple of "
                                   f"num_attention_heads {heads}; expected a head_dim field")
        head_dim = hidden // heads
    dtype = config.get("torch_dtype") or config.get("dtype") or "float16"
    dtype = _DTYPE_NAMES.get(str(dtype), str(dtype))
    return ModelShape(config.get("_name_or_path") or path.parent.name, layers, heads, kv_heads,
                      head_dim, f"{path}", dtype=dtype if dtype.lower() in DTYPE_BYTES else "fp16")


def resolve_model(name_or_path: str) -> ModelShape:
    """A built-in shape by name, else a config.json (file or folder) at that path."""
    key = name_or_path.lower()
    if key in BUILTIN_MODELS:
        return BUILTIN_MODELS[key]
    path = Path(name_or_path)
    if path.exists():
        return from_hf_config(path)
    raise ModelConfigError(f"{name_or_path}: expected a built-in model "
                           f"({', '.join(BUILTIN_MODELS)}) or a config.json path")


def shape_from_pool(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str,
                    name: Optional[str] = None) -> ModelShape:
    """The shape a kvdiag log's ``kv_pool_info`` event states (query heads unknown: 0)."""
    dtype = _DTYPE_NAMES.get(dtype, dtype)
    return ModelShape(name or "from log", num_layers, 0, num_kv_heads, head_dim,
                      "the log's kv_pool_info event", dtype=dtype)

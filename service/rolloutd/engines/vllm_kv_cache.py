"""How much KV cache the vLLM engine asks for.

Kept free of vLLM imports so that it can be tested, and read, without an engine.

An explicit ``engine.vllm.kv_cache_memory_gib`` wins. On GPU vLLM sizes the cache itself from
``gpu_memory_utilization``. On CPU, vLLM's backend otherwise reserves ``gpu_memory_utilization``
(0.9) of the whole NUMA node and refuses to start when that much is not free, which fails on any
machine whose memory is in use (a browser, the page cache an install leaves behind). rolloutd
instead asks for what its own limits can use: one full-length sequence per sibling that may be
generating at once. vLLM then skips the fraction check altogether.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rolloutd.domain.engine import EngineStartError
from rolloutd.engines.vllm_config import VLLMConfig

logger = logging.getLogger(__name__)

GIB = 2**30

CPU_KV_CACHE_CAP_GIB = 4.0
"""The most KV cache rolloutd reserves on CPU unasked. A laptop's other programs need memory too;
vLLM queues the sequences that do not fit. ``engine.vllm.kv_cache_memory_gib`` sets any size."""

_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


@dataclass(frozen=True)
class KVCachePlan:
    """The KV cache rolloutd asks vLLM for, and how it was arrived at (for the start-up log)."""

    bytes: int
    bytes_per_token: int
    sequences: int
    tokens_per_sequence: int
    capped: bool

    def describe(self) -> str:
        text = (
            f"KV cache {self.bytes / GIB:.2f} GiB: {self.sequences} sequences of "
            f"{self.tokens_per_sequence} tokens at {self.bytes_per_token} bytes a token"
        )
        if self.capped:
            text += f", capped at {CPU_KV_CACHE_CAP_GIB:g} GiB"
        return text + " (engine.vllm.kv_cache_memory_gib sets it)"


def kv_cache_bytes(
    settings: VLLMConfig, model_config: Mapping[str, Any], *, max_sequences: int, on_cpu: bool
) -> int | None:
    """The KV-cache size to start vLLM with. An explicit size wins. On CPU: room for every
    sibling the service may generate at once (``max_sequences``, at most ``max_num_seqs``). On
    GPU: None, and vLLM sizes it from ``gpu_memory_utilization``."""
    if settings.kv_cache_memory_gib is not None:
        return int(settings.kv_cache_memory_gib * GIB)
    if not on_cpu:
        return None
    plan = plan_cpu_kv_cache(
        model_config,
        settings.dtype,
        sequences=min(max_sequences, settings.max_num_seqs),
        max_model_len=settings.max_model_len,
    )
    logger.info("%s", plan.describe())
    return plan.bytes


def kv_bytes_per_token(model_config: Mapping[str, Any], dtype: str) -> int:
    """Bytes of keys and values one token occupies across all layers.

    ``model_config`` is a Hugging Face ``config.json``; multimodal models keep the language model's
    shape under ``text_config``. ``dtype`` is the engine's dtype, ``auto`` meaning the model's own.
    """
    cfg = model_config.get("text_config") or model_config
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    layers = int(cfg["num_hidden_layers"])
    if dtype == "auto":
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or model_config.get("dtype", ""))
    return 2 * layers * kv_heads * head_dim * _DTYPE_BYTES.get(dtype, 2)


def plan_cpu_kv_cache(
    model_config: Mapping[str, Any], dtype: str, *, sequences: int, max_model_len: int
) -> KVCachePlan:
    """Room for ``sequences`` sequences of ``max_model_len`` tokens, at most the cap, and never
    less than one full-length sequence (vLLM refuses to start with less)."""
    per_token = kv_bytes_per_token(model_config, dtype)
    wanted = sequences * max_model_len * per_token
    floor = max_model_len * per_token
    cap = max(int(CPU_KV_CACHE_CAP_GIB * GIB), floor)
    return KVCachePlan(
        bytes=min(wanted, cap),
        bytes_per_token=per_token,
        sequences=sequences,
        tokens_per_sequence=max_model_len,
        capped=wanted > cap,
    )


def read_model_config(path: Path) -> dict[str, Any]:
    """The model directory's ``config.json``, which the KV cache is sized from; a directory that
    is not a Hugging Face model fails the start with a line naming ``engine.model``."""
    try:
        config: dict[str, Any] = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        what = "does not exist" if not path.exists() else "has no config.json"
        raise EngineStartError(
            f"engine.model (--model): {path} {what}; it must be a Hugging Face model directory"
        ) from None
    except (OSError, ValueError) as exc:
        raise EngineStartError(f"engine.model (--model): {path}/config.json: {exc}") from None
    return config

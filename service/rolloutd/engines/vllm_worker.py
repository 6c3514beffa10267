"""Methods rolloutd adds to vLLM's workers (``worker_extension_cls``), for loading part of the
weights: the tensors a delta changed.

Runs inside vLLM's worker processes, so it imports nothing of rolloutd. Two calls, so that the
pause is only the load:

1. :meth:`RolloutdWorker.rolloutd_stage` (generation running) reads the named tensors from the
   safetensors files into memory, with every tensor that shares a vLLM layer with one of them
   (vLLM fuses ``q_proj``/``k_proj``/``v_proj`` into one ``qkv_proj``, and a layer is processed
   once all of its parameters arrived: a layer given only some of them would be rebuilt with the
   others missing);
2. :meth:`RolloutdWorker.rolloutd_load_staged` (generation paused) loads them through vLLM's own
   in-place reload, which re-runs each loaded layer's post-processing (the CPU backend repacks
   linear weights for oneDNN) and puts the untouched layers' tensors back as they were.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

_RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)


class _ExpectedPartialLoad(logging.Filter):
    """A partial load is the point here: vLLM's warnings that some layers or weights were not
    loaded (it puts them back unchanged) are expected, not a sign of a broken checkpoint."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (
            "Failed to load weights" in message or "were not loaded from checkpoint" in message
        )


def complete_layers(names: set[str], available: set[str], packed: dict[str, list[str]]) -> set[str]:
    """``names`` with every tensor of ``available`` that belongs to the same vLLM layer: the same
    module, or a module packed with it (``packed``: the model's ``packed_modules_mapping``)."""
    siblings: dict[str, list[str]] = {}
    for members in packed.values():
        for member in members:
            siblings[member] = members
    modules: set[str] = set()
    for name in names:
        module = name.rpartition(".")[0]
        parent, _, leaf = module.rpartition(".")
        for member in siblings.get(leaf, [leaf]):
            modules.add(f"{parent}.{member}" if parent else member)
    return {n for n in available if n.rpartition(".")[0] in modules}


class RolloutdWorker:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    _rolloutd_staged: list[tuple[str, torch.Tensor]] | None = None

    def rolloutd_stage(self, path: str, names: list[str]) -> int:
        """Reads ``names`` (completed to whole layers) from the safetensors files under
        ``path``; returns how many tensors were staged."""
        worker: Any = self
        model = worker.model_runner.get_model()
        packed = dict(getattr(type(model), "packed_modules_mapping", {}) or {})
        files = sorted(Path(path).glob("*.safetensors"))
        available: dict[str, Path] = {}
        for file in files:
            with safe_open(str(file), "pt", device="cpu") as f:
                available.update(dict.fromkeys(f.keys(), file))
        wanted = complete_layers(set(names), set(available), packed)
        staged: list[tuple[str, torch.Tensor]] = []
        for file in files:
            with safe_open(str(file), "pt", device="cpu") as f:
                staged += [(n, f.get_tensor(n)) for n in f.keys() if n in wanted]  # noqa: SIM118
        self._rolloutd_staged = staged
        return len(staged)

    def rolloutd_load_staged(self) -> int:
        """Loads what :meth:`rolloutd_stage` read; returns how many tensors were loaded."""
        staged, self._rolloutd_staged = self._rolloutd_staged, None
        if staged is None:
            raise RuntimeError("rolloutd_load_staged called without rolloutd_stage")
        worker: Any = self
        quiet = _ExpectedPartialLoad()
        for name in _RELOAD_LOGGERS:
            logging.getLogger(name).addFilter(quiet)
        try:
            worker.reload_weights(weights_iterator=iter(staged), is_checkpoint_format=True)
        finally:
            for name in _RELOAD_LOGGERS:
                logging.getLogger(name).removeFilter(quiet)
        return len(staged)

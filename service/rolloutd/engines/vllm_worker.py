"""Methods rolloutd adds to vLLM's workers (``worker_extension_cls``), for loading part of the
weights: the tensors a delta changed.

Runs inside vLLM's worker processes, so it imports nothing of rolloutd but the torch adapter
(:mod:`rolloutd.engines.torch_modules`, torch only). Two calls, so that the pause is only the
load:

1. :meth:`RolloutdWorker.rolloutd_stage` (generation running) reads the named tensors from the
   safetensors files, with every tensor that shares a vLLM layer with one of them (vLLM fuses
   ``q_proj``/``k_proj``/``v_proj`` into one ``qkv_proj``: a fused weight is rebuilt from all of
   its parts), and builds each affected layer's new weights in the engine's own format: the
   model's weight loaders fill fresh tensors, and the layer's quantization method processes them
   as at start-up (on CPU this packs each linear weight for oneDNN). The worker does this between
   two engine steps, on fresh tensors swapped into the layer and swapped back out before the
   call returns, so generation goes on with the served weights.
2. :meth:`RolloutdWorker.rolloutd_load_staged` (generation paused) copies the prepared values into
   the layers' existing tensors (their storage is kept: compiled code holds it) and installs what
   the processing made (the CPU backend's packed-weight matmul): no file read, no packing.

A layer whose parameter another layer shares (tied input and output embeddings) is not prepared
this way: that update goes through vLLM's own in-place reload of the staged tensors, in the pause.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
from vllm.model_executor.model_loader.reload.meta import materialize_layer, restore_layer_on_meta

from rolloutd.engines.torch_modules import (
    TENSOR_MEMBERS,
    Tensors,
    own_tensors,
    persistent_tensors,
    restore_tensors,
    set_parameter,
)

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


def layer_names(names: set[str], packed: dict[str, list[str]]) -> set[str]:
    """The vLLM modules that checkpoint tensors ``names`` load into: a tensor of a packed member
    (``q_proj``) loads into the packed module (``qkv_proj``)."""
    packed_into = {member: fused for fused, members in packed.items() for member in members}
    modules = set()
    for name in names:
        parent, _, leaf = name.rpartition(".")[0].rpartition(".")
        leaf = packed_into.get(leaf, leaf)
        modules.add(f"{parent}.{leaf}" if parent else leaf)
    return modules


@dataclass
class _Prepared:
    """One layer's new weights in the engine's format, built while the old ones serve."""

    layer: torch.nn.Module
    tensors: dict[str, torch.Tensor]
    """The processed parameters and buffers, by name; copied into the layer's own in the pause."""
    attributes: dict[str, Any]
    """Plain attributes the processing set (the CPU backend's ``cpu_linear``); set in the pause."""

    def install(self) -> None:
        for name, tensor in self.tensors.items():
            target = getattr(self.layer, name)
            if target.shape != tensor.shape:
                raise RuntimeError(
                    f"{type(self.layer).__name__}.{name}: prepared {tuple(tensor.shape)}, "
                    f"the engine holds {tuple(target.shape)}"
                )
            target.data.copy_(tensor)
        vars(self.layer).update(self.attributes)


def _prepare(
    model: Any, layers: list[torch.nn.Module], staged: list[tuple[str, torch.Tensor]]
) -> list[_Prepared]:
    """Each of ``layers`` loaded with ``staged`` and processed as at start-up, on fresh tensors;
    every layer is left as it was. Must run where no forward pass can interleave (a worker call).
    """
    saved: list[tuple[Tensors, dict[str, Any]]] = [
        (own_tensors(layer), {k: v for k, v in vars(layer).items() if k not in TENSOR_MEMBERS})
        for layer in layers
    ]
    prepared: list[_Prepared] = []
    try:
        for layer, (served, _) in zip(layers, saved, strict=True):
            info = get_layerwise_info(layer)
            if not info.restore_metadata[0]:
                raise RuntimeError(f"{type(layer).__name__}: vLLM kept no metadata to reload it")
            restore_layer_on_meta(layer, info)
            materialize_layer(layer, info)
            for name, current in own_tensors(layer).parameters.items():
                if current is None:
                    continue
                param: Any = current
                if param is served.parameters.get(name):  # not restored by vLLM (a bias)
                    param = _copy(current)  # load a copy
                    set_parameter(layer, name, param)
                loader = _original_loader(param)
                if loader is not None:
                    param.weight_loader = loader
        model.load_weights(iter(staged))
        for layer, (_, attributes) in zip(layers, saved, strict=True):
            method = getattr(layer, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(layer)
            changed = {
                k: v
                for k, v in vars(layer).items()
                if k not in TENSOR_MEMBERS and (k not in attributes or attributes[k] is not v)
            }
            prepared.append(_Prepared(layer, persistent_tensors(layer), changed))
    finally:
        for layer, (served, attributes) in zip(layers, saved, strict=True):
            restore_tensors(layer, served)
            state = vars(layer)
            for key in [k for k in state if k not in TENSOR_MEMBERS and k not in attributes]:
                del state[key]
            state.update(attributes)
    return prepared


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` with its class and attributes (a vLLM parameter's loader)."""
    copy = tensor.data.clone()
    copy.__class__ = tensor.__class__
    copy.__dict__ = tensor.__dict__.copy()
    return copy


def _original_loader(tensor: torch.Tensor) -> Any:
    """The tensor's weight loader (None: vLLM's default one) without the wrappers a vLLM reload
    leaves on its metadata (they would defer the load into the reload's own bookkeeping)."""
    # A plain attribute on some parameters, a property of vLLM's parameter classes; a tensor
    # without one loads through vLLM's default loader, as in vLLM's own reload.
    loader = getattr(tensor, "weight_loader", None)
    while loader is not None and loader.__name__ == "online_process_loader":
        loader = loader.__wrapped__
    return loader


def _shared(model: torch.nn.Module, layers: list[torch.nn.Module]) -> bool:
    """Whether a module outside ``layers`` holds one of their parameters (tied weights)."""
    inside = {id(layer) for layer in layers}
    held = {id(p) for layer in layers for p in layer.parameters(recurse=False)}
    return any(
        id(p) in held
        for module in model.modules()
        if id(module) not in inside
        for p in module.parameters(recurse=False)
    )


class RolloutdWorker:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    _rolloutd_staged: list[tuple[str, torch.Tensor]] | None = None
    _rolloutd_prepared: list[_Prepared] | None = None

    def rolloutd_stage(self, path: str, names: list[str]) -> int:
        """Reads ``names`` (completed to whole layers) from the safetensors files under
        ``path`` and prepares the affected layers; returns how many tensors were staged."""
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
        layers = [model.get_submodule(m) for m in sorted(layer_names(wanted, packed))]
        self._rolloutd_staged, self._rolloutd_prepared = None, None
        if _shared(model, layers):
            self._rolloutd_staged = staged
        else:
            with torch.no_grad():
                self._rolloutd_prepared = _prepare(model, layers, staged)
        return len(staged)

    def rolloutd_load_staged(self) -> int:
        """Installs what :meth:`rolloutd_stage` prepared (or, for tied weights, loads what it
        read through vLLM's reload); returns how many layers or tensors were loaded."""
        prepared, self._rolloutd_prepared = self._rolloutd_prepared, None
        staged, self._rolloutd_staged = self._rolloutd_staged, None
        if prepared is not None:
            with torch.no_grad():
                for layer in prepared:
                    layer.install()
            return len(prepared)
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

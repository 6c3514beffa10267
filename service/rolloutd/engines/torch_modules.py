"""The one module of rolloutd that uses members torch keeps private: where an ``nn.Module`` holds
its own tensors.

:mod:`rolloutd.engines.vllm_worker` builds a layer's new weights on fresh tensors swapped into the
layer, then swaps the served ones back, exactly as they were: the same dict entries (``None``
ones included), the same buffers marked non-persistent, and none of the tensors vLLM's reload
added left behind. torch's public API adds or replaces one parameter or buffer at a time
(``register_parameter``, ``register_buffer``) and has no way to take a whole set back, so this
module reads and sets the three members of a module's ``__dict__`` that hold them:

- ``Module._parameters``: its own parameters by name (a value may be ``None``);
- ``Module._buffers``: its own buffers by name (likewise);
- ``Module._non_persistent_buffers_set``: the names of the buffers ``state_dict`` leaves out.

Runs inside vLLM's worker processes: it imports torch only. ``tests/engines/test_torch_modules.py``
fails when a torch release moves or changes any of them; ``pyproject.toml`` pins torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TENSOR_MEMBERS = ("_parameters", "_buffers", "_non_persistent_buffers_set")
"""The parts of a module's ``__dict__`` that hold its tensors; the rest are plain attributes."""


@dataclass(frozen=True)
class Tensors:
    """A copy of what holds a module's own tensors (not its children's)."""

    parameters: dict[str, torch.nn.Parameter | None]
    buffers: dict[str, torch.Tensor | None]
    non_persistent: set[str]


def own_tensors(module: torch.nn.Module) -> Tensors:
    """What holds ``module``'s own tensors now, copied (the tensors themselves are not)."""
    return Tensors(
        dict(module._parameters),
        dict(module._buffers),
        set(module._non_persistent_buffers_set),
    )


def restore_tensors(module: torch.nn.Module, tensors: Tensors) -> None:
    """Puts back what :func:`own_tensors` copied, in the module's own dicts (whatever was added
    since is gone)."""
    module._parameters.clear()
    module._parameters.update(tensors.parameters)
    module._buffers.clear()
    module._buffers.update(tensors.buffers)
    module._non_persistent_buffers_set.clear()
    module._non_persistent_buffers_set.update(tensors.non_persistent)


def set_parameter(module: torch.nn.Module, name: str, parameter: torch.Tensor) -> None:
    """Makes ``parameter`` the module's own parameter ``name`` as it is: no check that it is an
    ``nn.Parameter`` (a copy of a vLLM parameter keeps its class and attributes)."""
    module._parameters[name] = parameter  # type: ignore[assignment]


def persistent_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's own parameters and persistent buffers that are set, by name: what its
    ``state_dict`` holds for itself."""
    tensors: dict[str, torch.Tensor] = {
        n: t for n, t in module._parameters.items() if t is not None
    }
    tensors |= {
        n: t
        for n, t in module._buffers.items()
        if t is not None and n not in module._non_persistent_buffers_set
    }
    return tensors

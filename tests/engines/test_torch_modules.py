"""torch still keeps a module's own tensors in the three members that
:mod:`rolloutd.engines.torch_modules` reads and sets, and putting a copy of them back restores
the module exactly; a torch release that moves or changes one fails here first."""

from __future__ import annotations

import torch

from rolloutd.engines.torch_modules import (
    TENSOR_MEMBERS,
    own_tensors,
    persistent_tensors,
    restore_tensors,
    set_parameter,
)


def layer() -> torch.nn.Module:
    module = torch.nn.Linear(3, 2)
    module.register_buffer("scale", torch.ones(2))
    module.register_buffer("scratch", torch.zeros(2), persistent=False)
    module.register_parameter("unused", None)
    module.inner = torch.nn.Linear(2, 2)  # a child: its tensors are its own, not the layer's
    return module


def test_the_members_hold_the_modules_own_tensors_as_the_public_api_reports_them():
    module = layer()
    assert set(TENSOR_MEMBERS) <= set(vars(module))
    tensors = own_tensors(module)
    assert {n for n, p in tensors.parameters.items() if p is not None} == {
        n for n, _ in module.named_parameters(recurse=False)
    }
    assert tensors.parameters["unused"] is None
    assert {n for n, b in tensors.buffers.items() if b is not None} == {
        n for n, _ in module.named_buffers(recurse=False)
    }
    assert tensors.non_persistent == {"scratch"}
    own_state = {k: v for k, v in module.state_dict(keep_vars=True).items() if "." not in k}
    assert persistent_tensors(module).keys() == own_state.keys()
    assert all(persistent_tensors(module)[k] is v for k, v in own_state.items())


def test_a_swap_and_a_restore_leave_the_module_as_it_was():
    module = layer()
    served = own_tensors(module)
    weight, scale = module.weight, module.scale
    set_parameter(module, "weight", torch.nn.Parameter(torch.full((2, 3), 7.0)))
    module.register_buffer("added", torch.ones(1))
    module.register_buffer("scale", torch.zeros(2), persistent=False)
    assert float(module.weight.detach()[0, 0]) == 7.0 and "scale" not in module.state_dict()
    restore_tensors(module, served)
    assert module.weight is weight and module.scale is scale
    assert "added" not in dict(module.named_buffers()) and not hasattr(module, "added")
    assert "scale" in module.state_dict() and "scratch" not in module.state_dict()
    assert module(torch.ones(1, 3)).shape == (1, 2)

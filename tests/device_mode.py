"""``pytest --torch-device cuda``: tensors made by tests go to the device, the library's don't.

:class:`TensorsOnDevice` is a torch function mode that gives the tensor factories
(``torch.zeros``, ``torch.randn``, ``torch.tensor``, ... and so every ``torch.nn`` module
built by a test) the test device, *when the call comes from test code*. It walks the
Python stack outward from the factory call: the first frame that decides is either a
test (``tests/``: the device) or the library (``geoopt_quotient/``: left alone, so that
a tensor the library makes without ``device=`` stays on the CPU and the test fails on
the mismatch, as it would for a user). Frames of other packages (torch, transformers,
hypothesis) are looked through, and so are

- the test kit ``geoopt_quotient.testing`` (its strategies build the tests' inputs),
  except ``testing/invariance.py``, whose helpers act on a user's model and must follow
  that model's device;
- library functions whose ``device`` argument is ``None`` (``GLQuotient.random``, the
  layers' constructors...), which by torch's convention mean the default device.

A CPU ``torch.Generator`` passed to a factory, or to an in-place sampler such as
``Tensor.uniform_``, draws on the CPU and the result is copied to the device, so a test
sees the same numbers on every device.
"""

from __future__ import annotations

import pathlib
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

_HERE = str(pathlib.Path(__file__).resolve())
_ROOT = pathlib.Path(_HERE).parent.parent
TESTS = str(_ROOT / "tests") + "/"
LIBRARY = str(_ROOT / "geoopt_quotient") + "/"
TEST_KIT = LIBRARY + "testing/"
MODEL_HELPERS = TEST_KIT + "invariance.py"
IN_PLACE_SAMPLERS = {
    torch.Tensor.uniform_,
    torch.Tensor.normal_,
    torch.Tensor.random_,
    torch.Tensor.exponential_,
    torch.Tensor.bernoulli_,
    torch.Tensor.cauchy_,
    torch.Tensor.log_normal_,
    torch.Tensor.geometric_,
}


def called_from_tests() -> bool:
    """Whether the innermost deciding frame of the current call stack is test code."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if path == _HERE:
            pass
        elif path.startswith(TESTS):
            return True
        elif path.startswith(LIBRARY) and not _see_through(frame):
            return False
        frame = frame.f_back
    return False


def _see_through(frame) -> bool:
    path = frame.f_code.co_filename
    if path.startswith(TEST_KIT):
        return path != MODEL_HELPERS
    code = frame.f_code
    arguments = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    return "device" in arguments and frame.f_locals.get("device", 0) is None


class TensorsOnDevice(TorchFunctionMode):
    """Tensor factories called from tests create their tensors on ``device``."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = torch.device(device)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        generator = kwargs.get("generator")
        if (
            func in IN_PLACE_SAMPLERS
            and _elsewhere(generator, args[0].device)
            and called_from_tests()
        ):
            with torch.no_grad():
                drawn = func(
                    torch.empty_like(args[0], device=generator.device), *args[1:], **kwargs
                )
                return args[0].copy_(drawn)
        if (
            func not in _device_constructors()
            or kwargs.get("device") is not None
            or not called_from_tests()
        ):
            return func(*args, **kwargs)
        if not _elsewhere(generator, self.device):
            kwargs["device"] = self.device
            return func(*args, **kwargs)
        requires_grad = kwargs.pop("requires_grad", False)
        out = func(*args, **kwargs).to(self.device)
        return out.requires_grad_(requires_grad) if requires_grad else out


def _elsewhere(generator: torch.Generator | None, device: torch.device) -> bool:
    return generator is not None and generator.device.type != device.type

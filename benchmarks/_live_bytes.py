"""The peak of the tensors and NumPy arrays that a call makes, while it runs (exact, no
timing): what a step of the package holds for a moment, beyond what it keeps."""

from __future__ import annotations

import tracemalloc
import weakref
from typing import Any, Callable, Dict, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that operations under this mode made and that are alive,
    their peak, and the most entries of an integer or boolean tensor an operation made.

    A storage counts from the operation that makes it until the last tensor an operation
    returned on it dies; views of tensors made outside the mode do not count.
    """

    def __init__(self):
        super().__init__()
        self.live = self.peak = self.largest_integer = 0
        self._storages: Dict[int, list] = {}  # data pointer -> [tensors alive, bytes]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and t.device.type != "meta"
        }
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            if not (t.is_floating_point() or t.is_complex()):
                self.largest_integer = max(self.largest_integer, t.numel())
            pointer = t.untyped_storage().data_ptr()
            entry = self._storages.get(pointer)
            if entry is None:
                if pointer == 0 or pointer in inputs:
                    continue  # no memory, or a view of a tensor made elsewhere
                entry = self._storages[pointer] = [0, t.untyped_storage().nbytes()]
                self.live += entry[1]
                self.peak = max(self.peak, self.live)
            entry[0] += 1
            weakref.finalize(t, self._release, pointer)
        return out

    def _release(self, pointer: int) -> None:
        entry = self._storages[pointer]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._storages[pointer]


def transient(fn: Callable[[], Any]) -> Tuple[Any, Dict[str, int]]:
    """``fn()`` and what it held for a moment: ``tensor_peak`` and ``tensor_kept`` (bytes
    of tensors at the peak and still alive when it returns), ``numpy_peak`` (NumPy's and
    Python's allocations, ``tracemalloc``) and ``largest_integer`` (entries)."""
    tracemalloc.start()
    try:
        with LiveBytes() as mode:
            result = fn()
        _, numpy_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, {
        "tensor_peak": mode.peak,
        "tensor_kept": mode.live,
        "numpy_peak": numpy_peak,
        "largest_integer": mode.largest_integer,
    }

"""The benchmarks' choice of glibc malloc behaviour (``--malloc``), applied process-wide.

glibc serves an allocation above its mmap threshold (dynamic: it rises to the size of
the largest such block freed, up to 32 MiB on 64-bit) with a fresh ``mmap`` and returns it
to the kernel when freed, and trims the top of its heap when more than the trim
threshold is free there. Memory handed back is faulted in again, page by page, at its
next use: a model-sized temporary costs one minor page fault per 4 KiB page each time
it is allocated, which shows as system time.

- ``default``: glibc's own behaviour, untouched;
- ``retain``: ``mallopt(M_MMAP_THRESHOLD, 2**31 - 1)`` (no allocation up to 2 GiB gets
  an ``mmap`` of its own) and ``mallopt(M_TRIM_THRESHOLD, 2**31 - 1)`` (the heap's top is
  not trimmed until 2 GiB of it are free), so that freed memory stays in the process and
  is reused without faults. The same as starting the process with
  ``MALLOC_MMAP_THRESHOLD_=2147483647 MALLOC_TRIM_THRESHOLD_=2147483647``; a block above
  the threshold (a tensor over 2 GiB) is still mapped on its own.

The plain passes and the sharpness runs of one process see the same setting, so their
ratios stay side by side; :func:`configure_malloc` is called before the models are
built, and its record goes into the result JSON.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
from typing import Any, Dict

MALLOC_CHOICES = ("default", "retain")

#: ``mallopt`` parameters (``<malloc.h>``)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: The largest value ``mallopt`` takes (an ``int``).
RETAIN_BYTES = 2**31 - 1


def configure_malloc(choice: str) -> Dict[str, Any]:
    """Applies ``choice`` (:data:`MALLOC_CHOICES`) to this process's glibc malloc and
    returns what was set, for the result JSON: ``{"malloc": choice, "applied": bool,
    ...}``, with a ``"note"`` saying why not where the C library is not glibc (the run
    goes on with the allocator's defaults, and says so)."""
    if choice not in MALLOC_CHOICES:
        raise ValueError(f"--malloc must be one of {MALLOC_CHOICES}, got {choice!r}")
    record: Dict[str, Any] = {"malloc": choice, "applied": choice == "default"}
    libc_name, libc_version = platform.libc_ver()
    record["libc"] = f"{libc_name} {libc_version}".strip() or "unknown"
    if choice == "default":
        return record
    if libc_name != "glibc":
        record["note"] = (
            f"--malloc retain needs glibc's mallopt; this C library is {record['libc']}: "
            "running with the allocator's defaults"
        )
        print(record["note"])
        return record
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
    settings = {"mmap_threshold": M_MMAP_THRESHOLD, "trim_threshold": M_TRIM_THRESHOLD}
    accepted = {name: bool(libc.mallopt(code, RETAIN_BYTES)) for name, code in settings.items()}
    record["applied"] = all(accepted.values())
    record.update({name: RETAIN_BYTES for name, ok in accepted.items() if ok})
    if not record["applied"]:
        refused = [name for name, ok in accepted.items() if not ok]
        record["note"] = f"mallopt refused {refused}: those stay at glibc's defaults"
        print(record["note"])
    return record

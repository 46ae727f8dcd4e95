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
- ``huge`` (Linux): PyTorch's own switch ``THP_MEM_ALLOC_ENABLE=1``, with which its CPU
  allocator aligns each allocation to a page and asks the kernel for transparent huge
  pages on those of 2 MiB or more (``madvise``). Freed blocks still go back to the kernel, but are
  faulted in again 2 MiB at a time: about 512 times fewer faults. It needs the kernel's
  transparent huge pages set to ``always`` or ``madvise``
  (``/sys/kernel/mm/transparent_hugepage/enabled``); PyTorch reads the variable at its
  first allocation on the CPU, so :func:`configure_malloc` checks that it took (the page
  faults of a fresh 64 MiB tensor) and says so where it did not.

The plain passes and the sharpness runs of one process see the same setting, so their
ratios stay side by side; :func:`configure_malloc` is called before the models are
built, and its record goes into the result JSON.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import platform
import sys
from pathlib import Path
from typing import Any, Dict

MALLOC_CHOICES = ("default", "retain", "huge")
#: PyTorch's switch for transparent huge pages in its CPU allocator.
THP_VARIABLE = "THP_MEM_ALLOC_ENABLE"
#: The size of ``--malloc huge``'s probe, 32 huge pages of 2 MiB (its ends, in no 2 MiB
#: page of their own, take 4 KiB pages: up to 1022).
PROBE_BYTES = 64 << 20

#: ``mallopt`` parameters (``<malloc.h>``)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: The largest value ``mallopt`` takes (an ``int``).
RETAIN_BYTES = 2**31 - 1


def add_malloc_option(parser: argparse.ArgumentParser) -> None:
    """The benchmarks' ``--malloc`` option (:data:`MALLOC_CHOICES`), for
    :func:`configure_malloc`."""
    parser.add_argument(
        "--malloc",
        choices=MALLOC_CHOICES,
        default="default",
        help="memory of the process: glibc's malloc as it comes (default); retain freed "
        "memory in the process (no fresh mmap, so no page faults, per large allocation); "
        "or huge, PyTorch's THP_MEM_ALLOC_ENABLE=1 (large blocks in 2 MiB transparent huge "
        "pages: about 512 times fewer faults); benchmarks/_malloc.py. For the plain passes "
        "and the runs alike",
    )


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
    if choice == "huge":
        return _huge_pages(record)
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


def _huge_pages(record: Dict[str, Any]) -> Dict[str, Any]:
    """``--malloc huge``: :data:`THP_VARIABLE` set, and whether it took: a fresh tensor of
    :data:`PROBE_BYTES` faults in far fewer pages than its 4 KiB pages (PyTorch may have
    read the variable already, or the kernel may give no huge pages)."""
    os.environ[THP_VARIABLE] = "1"
    record[THP_VARIABLE] = "1"
    if sys.platform != "linux":
        record["applied"] = False
        record["note"] = f"--malloc huge needs Linux's transparent huge pages, not {sys.platform}"
        print(record["note"])
        return record
    import resource

    import torch

    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if mode.exists():
        record["transparent_hugepage"] = mode.read_text().strip()
    torch.ones(1, dtype=torch.uint8)  # the kernel's first call faults in code, not data
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(PROBE_BYTES, dtype=torch.uint8)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    record["probe_page_faults"] = faults
    record["applied"] = faults < PROBE_BYTES // 4096 // 4
    if not record["applied"]:
        record["note"] = (
            f"a fresh {PROBE_BYTES >> 20} MiB tensor faulted {faults} pages: no huge pages. "
            f"PyTorch reads {THP_VARIABLE} at its first allocation on the CPU (start the "
            f"process with {THP_VARIABLE}=1), and the kernel's transparent huge pages must "
            "be 'always' or 'madvise'"
        )
        print(record["note"])
    return record

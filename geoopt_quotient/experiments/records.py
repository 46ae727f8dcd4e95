"""Append-only JSON-lines records of finished work, so that long runs can resume."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Dict, Iterator, Mapping, Union

__all__ = ["RecordFile", "fingerprint"]


def fingerprint(settings: Mapping[str, Any]) -> str:
    """A short stable hash of the settings that determine a run's results.

    Parameters
    ----------
    settings : dict
        JSON-serialisable settings (other values are hashed by their ``str``).

    Returns
    -------
    str
        The first 16 hex digits of the SHA-256 of the settings as sorted JSON.
    """
    text = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class RecordFile:
    """One JSON object per line, each written, flushed and fsynced when its work finishes.

    A killed run loses at most the unit of work in progress. Lines that do not parse
    (a line cut off by the kill) are ignored on reading.

    Parameters
    ----------
    path : path-like
        The ``.jsonl`` file.
    resume : bool
        Keep existing records (``True``) or start a new file (``False``).
    """

    def __init__(self, path: Union[str, os.PathLike], *, resume: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not resume or not self.path.exists():
            self.path.write_text("")

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        with open(self.path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(record, dict):
                    yield record

    def append(self, record: Mapping[str, Any]) -> None:
        """Append one line; after a line cut off by a kill, start a new line first, so that
        the cut line alone is lost (and recomputed), not this record too."""
        with open(self.path, "a+b") as f:
            cut = False
            if f.seek(0, os.SEEK_END) > 0:
                f.seek(-1, os.SEEK_END)
                cut = f.read(1) != b"\n"
            line = json.dumps(record, default=float) + "\n"
            f.write((("\n" if cut else "") + line).encode())
            f.flush()
            os.fsync(f.fileno())

    def select(self, **match: Any) -> Iterator[Dict[str, Any]]:
        """Records whose fields equal ``match``."""
        return (r for r in self if all(r.get(k) == v for k, v in match.items()))

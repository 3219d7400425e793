"""A concurrent writer, placed exactly: a stand-in for one of kopf's indexes whose first look-up runs a write."""

from __future__ import annotations

from typing import Any, Callable


class InterferingIndex(dict):
    """Stands in for kopf's ``clusters_by_job`` index: its first look-up (inside ``gather``, after the reconcile's GET
    of the job and before its status write) runs ``write`` once, as a concurrent writer would. ``writes`` counts the
    writes it made (0 or 1)."""

    def __init__(self, write: Callable[[], Any]):
        super().__init__()
        self.write = write
        self.writes = 0

    def get(self, key: Any, default: Any = None) -> Any:
        if not self.writes:
            self.write()
            self.writes += 1
        return default

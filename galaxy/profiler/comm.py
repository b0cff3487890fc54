"""Communication accounting: an observer that the core's collectives call with one record each.

The profiler never times or wraps collectives itself (it observes core, never changes it): the
core measures each call and hands a record to every observer; ``CommLog`` stores and aggregates.
Any object with the attributes ``op, group, nbytes, seconds, phase`` is accepted, so the core may
use its own record type.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Optional

from galaxy.core.comm import CommRecord

__all__ = ["CommRecord", "CommLog"]


@dataclass
class _Agg:
    calls: int = 0
    nbytes: int = 0
    seconds: float = 0.0


class CommLog:
    """Stores communication records and aggregates them by (op, group, phase).

    Pass ``log.record`` (or ``log`` itself, it is callable) as an observer to the core. Call
    ``mark_step()`` once per optimizer step so per-step numbers can be reported; with no step
    marked, the whole log counts as one step. A ``FlopsProfiler`` given this log resets it when a
    profiling window opens and ignores records outside the window (``enabled`` is toggled).
    """

    def __init__(self, keep_records: bool = False) -> None:
        self.keep_records = keep_records
        self.enabled = True
        # Backward hooks may run on autograd worker threads.
        self._lock = threading.Lock()
        self._agg: dict[tuple[str, str, str], _Agg] = {}
        self._records: list[Any] = []
        self._steps = 0

    def record(self, rec: Any) -> None:
        if not self.enabled:
            return
        key = (str(rec.op), str(rec.group), str(rec.phase))
        with self._lock:
            agg = self._agg.setdefault(key, _Agg())
            agg.calls += 1
            agg.nbytes += int(rec.nbytes)
            agg.seconds += float(rec.seconds)
            if self.keep_records:
                self._records.append(rec)

    __call__ = record

    def mark_step(self) -> None:
        with self._lock:
            self._steps += 1

    def reset(self) -> None:
        with self._lock:
            self._agg.clear()
            self._records.clear()
            self._steps = 0

    @property
    def steps(self) -> int:
        return self._steps

    @property
    def records(self) -> tuple:
        """Raw records (only kept with ``keep_records=True``)."""
        with self._lock:
            return tuple(self._records)

    def total_bytes(self, phase: Optional[str] = None) -> int:
        with self._lock:
            return sum(a.nbytes for (_, _, p), a in self._agg.items() if phase in (None, p))

    def summary(self) -> list[dict[str, Any]]:
        """One row per (op, group, phase), sorted by bytes, with per-step bytes and bandwidth."""
        steps = max(self._steps, 1)
        with self._lock:
            items = sorted(self._agg.items(), key=lambda kv: (-kv[1].nbytes, kv[0]))
        return [
            {
                "op": op,
                "group": group,
                "phase": phase,
                "calls": a.calls,
                "bytes": a.nbytes,
                "seconds": a.seconds,
                "bytes_per_step": a.nbytes / steps,
                "calls_per_step": a.calls / steps,
                # Algorithm bandwidth (bytes moved / time), not bus bandwidth.
                "GBps": (a.nbytes / a.seconds / 1e9) if a.seconds > 0 else None,
            }
            for (op, group, phase), a in items
        ]

    def bytes_per_step_by_op(self) -> dict[str, float]:
        """Bytes per step for each collective op name, summed over groups and phases."""
        out: dict[str, float] = {}
        for row in self.summary():
            out[row["op"]] = out.get(row["op"], 0.0) + row["bytes_per_step"]
        return out

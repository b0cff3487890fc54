"""The cluster file: per-rank compute shares and link bandwidths, typed and validated.

::

    {
      "ranks": [
        {"compute_share": 1.0},
        {"compute_share": 0.5, "bandwidth_mbit": 50}
      ],
      "links": {"bandwidth_mbit": 100}
    }

- ``ranks`` (required, one object per rank, rank i is the i-th entry):
  - ``compute_share``: CPU cores the rank computes as fast as (``cpu_emulation`` says how): 1.0 is one
    full core, 0.5 a core at half speed, 2.0 two cores. ``null`` or absent: no limit, not pinned.
  - ``bandwidth_mbit``: this rank's link to the switch, in megabits per second (10^6 bit/s), shaped in
    both directions. Absent: ``links.bandwidth_mbit``.
- ``links`` (optional):
  - ``bandwidth_mbit``: every rank's link unless the rank names its own. ``null`` or absent: unshaped.
- ``cpu_emulation`` (optional, default ``"cores"``): how a share is enforced.
  ``"cores"``: a slower core. Every rank with a share is pinned to cores of its own (``placement``):
  a whole core per whole unit of share; ranks below one core are packed onto shared cores, and the
  rest of a core's time goes to a filler process of the matching weight, so the rank gets its share
  whenever it computes, right after waiting on a link too, for pieces longer than the scheduler's
  slice (a few ms; shorter ones after a wait run at nearly full speed: ``bench/bench_share.py``).
  Ranks that share a core are also capped by a CFS quota, so one's idle time is not the other's
  bonus. Needs as many cores as the placement. ``"dilate"``: a slower core at every piece length.
  Every rank gets cores of its own (one below a whole core, no filler), and a rank of share s < 1
  stretches each compute op to 1 / s times its duration (``slowdown.py``; Galaxy's CLIs only, other
  programs run at the core's speed). Needs a core per rank. ``"quota"``: a CFS quota alone, no
  pinning: fits any number of ranks, but a quota is a budget per period, not a slower core: a rank
  that waited on its link computes at full speed until the period's budget is spent, so a plan that
  communicates much runs faster than its share.
- ``cpu_period_us`` (optional, default 10000): the CFS period of the quotas; a shorter one bounds
  the burst after a wait more tightly, and below ~10 ms the kernel's 4 ms tick makes quotas lossy.

Unknown keys are errors, as everywhere in Galaxy.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

from galaxy.config import ConfigError

MIN_QUOTA_US = 1000  # the kernel refuses a cfs_quota_us below 1 ms
CPU_EMULATIONS = ("cores", "dilate", "quota")
SLOWDOWN_ENV = "GALAXY_EMULATE_SLOWDOWN"  # a rank's slowdown under "dilate", read by slowdown.py
DEFAULT_PERIOD_US = 10_000
MAX_RANKS = 4000  # one /16 of addresses, see network.rank_address
MAX_BANDWIDTH_MBIT = 100_000  # far beyond what a veth carries; faster is the same as unshaped


@dataclass(frozen=True)
class RankSpec:
    compute_share: Optional[float]  # CPU cores; None: no quota
    bandwidth_mbit: Optional[float]  # this rank's link, both directions; None: unshaped


@dataclass(frozen=True)
class Cluster:
    ranks: tuple[RankSpec, ...]
    cpu_period_us: int = DEFAULT_PERIOD_US
    cpu_emulation: str = "cores"

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def quota_us(self, rank: int) -> Optional[int]:
        share = self.ranks[rank].compute_share
        return None if share is None else max(MIN_QUOTA_US, round(share * self.cpu_period_us))

    def slowdown(self, rank: int) -> float:
        """How many times slower than its cores rank ``rank`` computes ops (``dilate``; else 1)."""
        share = self.ranks[rank].compute_share
        if self.cpu_emulation != "dilate" or share is None or share >= 1:
            return 1.0
        return 1.0 / share

    def subset(self, devices: Sequence[int], where: str = "cluster") -> "Cluster":
        """The cluster of ``devices`` alone (a plan that leaves some ranks idle): rank i of the run
        is device ``devices[i]``, with its compute share and link."""
        bad = [d for d in devices if not 0 <= d < self.world_size]
        if bad:
            raise ConfigError(f"config key 'devices' names rank {bad[0]}, but the {where} has ranks "
                              f"0..{self.world_size - 1}; plan for this cluster or fix 'devices'")
        return replace(self, ranks=tuple(self.ranks[d] for d in devices))

    @classmethod
    def from_dict(cls, raw: Any, where: str = "cluster") -> "Cluster":
        _check_keys(raw, where, {"ranks", "links", "cpu_period_us", "cpu_emulation"})
        links = raw.get("links", {})
        _check_keys(links, f"{where} key 'links'", {"bandwidth_mbit"})
        default_bw = _bandwidth(links.get("bandwidth_mbit"), f"{where} key 'links.bandwidth_mbit'")
        emulation = raw.get("cpu_emulation", "cores")
        if emulation not in CPU_EMULATIONS:
            raise ConfigError(f"{where} key 'cpu_emulation' must be one of {', '.join(CPU_EMULATIONS)}, "
                              f"got {emulation!r}")
        period = raw.get("cpu_period_us", DEFAULT_PERIOD_US)
        if isinstance(period, bool) or not isinstance(period, int) or not 1000 <= period <= 1_000_000:
            raise ConfigError(f"{where} key 'cpu_period_us' must be an integer from 1000 to 1000000 "
                              f"(microseconds), got {period!r}")
        ranks = raw.get("ranks")
        if not isinstance(ranks, list) or not ranks:
            raise ConfigError(f"{where} key 'ranks' must be a non-empty list with one object per rank, e.g. "
                              f'[{{"compute_share": 1.0}}, {{"compute_share": 0.5}}], got {ranks!r}')
        if len(ranks) > MAX_RANKS:
            raise ConfigError(f"{where} key 'ranks' lists {len(ranks)} ranks; at most {MAX_RANKS} are supported")
        specs = []
        for i, entry in enumerate(ranks):
            key = f"ranks[{i}]"
            _check_keys(entry, f"{where} key '{key}'", {"compute_share", "bandwidth_mbit"})
            share = _positive(entry.get("compute_share"), f"{where} key '{key}.compute_share'",
                              "CPU cores, e.g. 1.0 for one core or 0.5 for half, or null for no quota")
            if share is not None and share * period < MIN_QUOTA_US:
                raise ConfigError(f"{where} key '{key}.compute_share' {share} is below the kernel's minimum quota "
                                  f"({MIN_QUOTA_US} us per {period} us period); use at least {MIN_QUOTA_US / period}")
            bw = _bandwidth(entry["bandwidth_mbit"], f"{where} key '{key}.bandwidth_mbit'") \
                if "bandwidth_mbit" in entry else default_bw
            specs.append(RankSpec(compute_share=share, bandwidth_mbit=bw))
        return cls(ranks=tuple(specs), cpu_period_us=period, cpu_emulation=emulation)

    @classmethod
    def from_file(cls, path: str) -> "Cluster":
        if not os.path.isfile(path):
            raise ConfigError(f"cluster file '{path}' does not exist or is not a file; pass a JSON file such as "
                              '{"ranks": [{"compute_share": 1.0}, {"compute_share": 0.5}], '
                              '"links": {"bandwidth_mbit": 100}}')
        with open(path) as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"cluster file '{path}' is not valid JSON: {e}") from None
        return cls.from_dict(raw, where=f"cluster file '{path}'")


def _check_keys(section: Any, where: str, allowed: set[str]) -> None:
    if not isinstance(section, dict):
        raise ConfigError(f"{where} must be a JSON object, got {section!r}")
    for key in section:
        if key not in allowed:
            close = difflib.get_close_matches(key, sorted(allowed), n=1, cutoff=0.5)
            hint = f"did you mean '{close[0]}'?" if close else f"use one of {', '.join(sorted(allowed))}"
            raise ConfigError(f"{where} has unknown key '{key}'; {hint}")


def _bandwidth(value: Any, where: str) -> Optional[float]:
    bw = _positive(value, where, "megabits per second, e.g. 100, or null for an unshaped link")
    if bw is not None and bw > MAX_BANDWIDTH_MBIT:
        raise ConfigError(f"{where} {value} is above {MAX_BANDWIDTH_MBIT} Mbit/s, more than a veth carries; "
                          "use null for an unshaped link")
    return bw


def _positive(value: Any, where: str, meaning: str) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise ConfigError(f"{where} must be a positive number ({meaning}), got {value!r}")
    return float(value)

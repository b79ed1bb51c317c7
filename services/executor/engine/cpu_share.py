"""Torch's CPU threads, one fewer for each core other processes keep busy.

Every parallel op of a CPU step (a matmul, attention, a norm) ends in a barrier: the step's
threads wait there for the slowest. A thread that shares its core with a process that is always
runnable (a benchmark client pacing in a busy loop, a build, a neighbour's job) runs only in the
scheduler's time slices, and every barrier then waits out a slice of milliseconds: on a 2-core
host beside one busy process a single stream's TPOT was 132 ms with two threads and 55 ms with
one, and under aiperf (whose pacer keeps a core busy) streaming ITL 1,147 ms against 95
(BENCHMARKS.md, "A busy neighbour"). Processes that sleep between bursts cost only their share.

`CpuShare` reads, at most once an interval, how busy this process's CPUs (its affinity) were
over the last interval, less this process's own CPU time, and picks
`cpus - round(others)` threads, at least one and at most the configured count. A new count holds
only when two intervals in a row agree, so a single burst does not move it, or when one interval
was as long as two (the engine ran no step meanwhile: the count of before is stale). Not seen: CPU time
that a cgroup quota takes (a container's `--cpus` without a cpuset); the steal time of a VM's
host is counted as busy."""

from __future__ import annotations

import math
import os
import time

# /proc/stat's columns: user nice system idle iowait irq softirq steal (guest time is inside user)
_IDLE_COLUMNS = (3, 4)
_BUSY_COLUMNS = 8


def _cpus_busy_s(cpus: frozenset[int], ticks_per_s: float) -> float | None:
    """CPU seconds `cpus` have spent busy since boot (None: /proc/stat unreadable)."""
    total = 0
    try:
        with open("/proc/stat", "rb") as stat:
            for line in stat:
                if not line.startswith(b"cpu") or not line[3:4].isdigit():
                    continue
                name, *columns = line.split()
                if int(name[3:]) in cpus:
                    values = [int(v) for v in columns[:_BUSY_COLUMNS]]
                    total += sum(values) - sum(values[i] for i in _IDLE_COLUMNS)
    except (OSError, ValueError):
        return None
    return total / ticks_per_s


class CpuShare:
    """The thread count for this process's next CPU step (`threads`, cheap between intervals).
    `most`: the count to use while nothing else runs on these CPUs."""

    def __init__(self, most: int, interval_s: float = 1.0, cpus: frozenset[int] | None = None):
        self.most = max(1, most)
        self.interval_s = interval_s
        self.cpus = cpus if cpus is not None else frozenset(os.sched_getaffinity(0))
        self.ticks_per_s = float(os.sysconf("SC_CLK_TCK"))
        self.current = self.most
        self.others = 0.0  # cores other processes kept busy over the last interval
        self._pending: int | None = None
        self._last = self._sample()
        self.enabled = self._last is not None

    def _sample(self) -> tuple[float, float, float] | None:
        busy = _cpus_busy_s(self.cpus, self.ticks_per_s)
        if busy is None:
            return None
        return time.monotonic(), busy, time.process_time()

    def threads(self) -> int:
        if not self.enabled or time.monotonic() - self._last[0] < self.interval_s:
            return self.current
        sample = self._sample()
        if sample is None:
            return self.current
        (then, busy_then, own_then), (now, busy, own) = self._last, sample
        self._last = sample
        self.others = max(0.0, ((busy - busy_then) - (own - own_then)) / (now - then))
        wanted = self.pick(self.others)
        if wanted == self.current:
            self._pending = None
        elif wanted == self._pending or now - then >= 2 * self.interval_s:
            # Two intervals in a row agree, or one as long (no step ran for a while: the
            # count of before the pause is stale)
            self.current, self._pending = wanted, None
        else:
            self._pending = wanted
        return self.current

    def pick(self, others: float) -> int:
        """The count for `others` cores kept busy by other processes."""
        return max(1, min(self.most, len(self.cpus) - math.floor(others + 0.5)))

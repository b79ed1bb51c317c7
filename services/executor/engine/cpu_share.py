"""Torch's CPU threads, one fewer for each core other processes keep busy.

Every parallel op of a CPU step (a matmul, attention, a norm) ends in a barrier: the step's
threads wait there for the slowest. A thread that shares its core with a process that is always
runnable (a benchmark client pacing in a busy loop, a build, a neighbour's job) runs only in the
scheduler's time slices, and every barrier then waits out a slice of milliseconds: on a 2-core
host beside one busy process a single stream's TPOT was 103 ms with two threads and 43 ms with
one, and under aiperf (whose pacer keeps a core busy) streaming ITL 1,037 ms against 69
(BENCHMARKS.md, "A busy neighbour"). Processes that sleep between bursts cost only their share.

`CpuShare` reads, at most once an interval, how busy this process's CPUs (its affinity, read
again each time) were over the last interval, less this process's own CPU time: `others`, in
cores. Niced processes are not counted (the scheduler hands their core to a thread of ours at
once), unless this process is niced itself; a VM host's steal time is. The count is
`cpus - round(others)`, at least one, at most the configured count (kept whole while nothing
else keeps a core busy):

- it goes down at once: a thread too many beside a busy process costs far more than one too few;
- it goes up only when the cores have been free for `hold_s` (two intervals; a reading that
  covers a longer pause, the engine idle, counts its whole length), and with a margin (others
  at most 0.3 of a core for the last thread back, where 0.5 takes it);
- a fall within FLAP_INTERVALS of a rise (the rise caused it: executors sharing a host, each
  counting the others as busy) doubles `hold_s` (up to MAX_HOLD_INTERVALS intervals, a quarter
  more at random), so that they move it rarely, and apart; a later fall sets it back;
- with every core busy and this process short of its threads, what the others got is scaled
  up by that shortfall: they wanted more (oversubscribed executors would each read a share
  that rounds down, and stay so).

Not seen: CPU time that a cgroup quota takes (a container's `--cpus` without a cpuset)."""

from __future__ import annotations

import math
import os
import random
import time

# /proc/stat's per-CPU columns: user nice system idle iowait irq softirq steal (guest time is
# inside user). Busy: all but nice (unless this process is niced itself: its own time is
# there), idle and iowait.
_BUSY = (0, 2, 5, 6, 7)
_BUSY_NICED = (0, 1, 2, 5, 6, 7)
RAISE_MARGIN = 0.2  # cores: others must be this much lower for a thread to come back
FLAP_INTERVALS = 3  # a fall this soon after a rise: the rise caused it (another executor's)
MAX_HOLD_INTERVALS = 32
SATURATED = 0.95  # of the CPUs busy: what other processes got is less than they wanted


def _busy_by_cpu(columns_busy: tuple[int, ...]) -> dict[int, int] | None:
    """Busy ticks since boot of each CPU /proc/stat lists (None: unreadable)."""
    busy = {}
    try:
        with open("/proc/stat", "rb") as stat:
            for line in stat:
                if not line.startswith(b"cpu"):
                    break  # (the per-CPU lines come first)
                if not line[3:4].isdigit():
                    continue  # the sum over all CPUs
                name, *columns = line.split()
                busy[int(name[3:])] = sum(int(columns[i]) for i in columns_busy)
    except (OSError, ValueError, IndexError):
        return None
    return busy


class CpuShare:
    """The thread count for this process's next CPU step (`threads`, cheap between intervals).
    `most`: the count to use while nothing else runs on these CPUs."""

    def __init__(self, most: int, interval_s: float = 1.0):
        self.most = max(1, most)
        self.interval_s = interval_s
        self.hold_s = self._hold_now = 2 * interval_s
        self.ticks_per_s = float(os.sysconf("SC_CLK_TCK"))
        self.current = self.most
        self.others = 0.0  # cores other processes kept busy over the last reading
        self.cpus: frozenset[int] = frozenset()
        self._up_since: float | None = None  # since when a higher count has been wanted
        self._up_to = self.most
        self._raised_at = -math.inf
        self._last = self._sample()
        self.enabled = self._last is not None
        if self._last is not None:
            self.cpus = self._last[3][0]

    def _sample(self) -> tuple[float, float, float, tuple[frozenset[int], bool]] | None:
        """(now, busy CPU seconds of this process's CPUs, own CPU seconds, (those CPUs,
        whether this process is niced: its time is then in the nice column, counted))."""
        try:  # (the process's: the model thread's own may be bound to one CPU by OpenMP)
            niced = os.getpriority(os.PRIO_PROCESS, os.getpid()) > 0
            affinity = os.sched_getaffinity(os.getpid())
        except OSError:
            return None
        busy = _busy_by_cpu(_BUSY_NICED if niced else _BUSY)
        if busy is None:
            return None
        cpus = frozenset(affinity) & busy.keys()
        if not cpus:
            return None
        return (time.monotonic(), sum(busy[c] for c in cpus) / self.ticks_per_s,
                time.process_time(), (cpus, niced))

    def threads(self) -> int:
        if not self.enabled or time.monotonic() - self._last[0] < self.interval_s:
            return self.current
        sample = self._sample()
        if sample is None:
            return self.current
        (then, busy_then, own_then, how_then), (now, busy, own, how) = self._last, sample
        self._last, self.cpus = sample, how[0]
        if how != how_then or now <= then:  # the affinity, the CPUs online or the nice changed
            self._up_since = None
            return self.current
        return self.decide(then, now, self.others_of((busy - busy_then) / (now - then),
                                                     (own - own_then) / (now - then)))

    def others_of(self, busy: float, mine: float) -> float:
        """Cores other processes keep busy, from the cores busy on this process's CPUs and
        this process's own, over a reading."""
        others = max(0.0, busy - mine)
        if busy >= SATURATED * len(self.cpus) and 0 < mine < self.current:
            # Every core busy and this process's threads short of theirs: the others got less
            # than they would have taken (three executors on four cores, two threads each,
            # read 2.4 cores each of others, round it to 2 and stay oversubscribed).
            others *= self.current / mine
        return others

    def decide(self, then: float, now: float, others: float) -> int:
        """The count after a reading of `others` cores busy from `then` to `now`."""
        self.others = others
        lower = self.pick(self.others)
        if lower < self.current:
            flapping = now - self._raised_at < FLAP_INTERVALS * self.interval_s
            self.hold_s = min(2 * self.hold_s, MAX_HOLD_INTERVALS * self.interval_s) \
                if flapping else 2 * self.interval_s
            # (a quarter at random on top: executors that fell together rise apart)
            self._hold_now = self.hold_s * random.uniform(1.0, 1.25) if flapping \
                else self.hold_s
            self.current, self._up_since = lower, None
            return self.current
        higher = self.pick(self.others + RAISE_MARGIN)
        if higher <= self.current:
            self._up_since = None
            return self.current
        if self._up_since is None:
            self._up_since, self._up_to = then, higher
        else:
            self._up_to = min(self._up_to, higher)
        if now - self._up_since >= self._hold_now:
            self.current, self._up_since, self._raised_at = self._up_to, None, now
        return self.current

    def pick(self, others: float) -> int:
        """The count for `others` cores kept busy by other processes (on this process's CPUs
        as last read)."""
        taken = math.floor(others + 0.5)
        if taken == 0:
            return self.most
        return max(1, min(self.most, len(self.cpus) - taken))

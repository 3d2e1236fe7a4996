"""How many threads a CPU step runs on: the CPUs this process may use, less the ones other processes keep busy.

minivllm only. vLLM 0.32's CPU worker binds one OpenMP thread to each CPU it is given, once, at start-up
(``VLLM_CPU_OMP_THREADS_BIND``, default ``auto``: the CPUs of a NUMA node, ``vllm/v1/worker/cpu_worker.py``), and
keeps that count. Every parallel region of a step (a matrix product, an attention kernel) splits its work evenly
over the threads and ends at a barrier, so when another process holds one of the CPUs, each region waits for the
thread that shares that CPU, and a 2-core machine runs slower with two threads than with one: on the AVX-512 class,
170.4 output tok/s idle fell to 49.3 with two threads and a busy second core, and held at 110.7 with one
(``minivllm/bench/OPTIMISATIONS.md``, issue 27).

:class:`CpuThreadGovernor` reads, twice a second at most, how much CPU time the machine's other processes used on
this process's CPUs since the last reading (``/proc/stat`` less this process's own time, ``os.times``), and sets
``torch.set_num_threads`` to the CPUs left, at least one. It is on only when nobody chose a thread count: the
engine's worker builds one when torch's count at start-up equals the CPUs this process may run on, ``OMP_NUM_THREADS``
is unset and ``MINIVLLM_CPU_THREADS_AUTO`` is not ``0``. minivllm's own kernels give the same bits for any thread
count (each output is summed by one thread); oneDNN's and MKL's products need not, though SmolLM2's float32 logits
were bit-identical with one thread and two in every step of a mixed run checked on the AVX-512 class.
"""

from __future__ import annotations

import os
import time
import weakref
from typing import Callable, List, Optional, Tuple

import torch

#: Seconds between two readings of the machine's load; a step in between keeps the last decision.
INTERVAL_S = 0.5


def proc_stat_busy_seconds(cpus: List[int], path: str = "/proc/stat") -> float:
    """CPU seconds spent not idle on ``cpus`` since boot, by every process (``/proc/stat``'s per-CPU lines: all
    fields but ``idle`` and ``iowait``, in clock ticks; ``guest`` time is already inside ``user``).

    Raises:
        OSError: no ``/proc/stat`` (not Linux).
    """
    ticks = os.sysconf("SC_CLK_TCK")
    wanted = {f"cpu{c}" for c in cpus}
    busy = 0
    with open(path) as f:
        for line in f:
            parts = line.split()
            if parts and parts[0] in wanted:
                values = [int(v) for v in parts[1:9]]  # user nice system idle iowait irq softirq steal
                busy += sum(values) - values[3] - values[4]
    return busy / ticks


def own_cpu_seconds() -> float:
    """CPU seconds this process has used, all its threads (``os.times``)."""
    t = os.times()
    return t.user + t.system


class CpuThreadGovernor:
    """Sets torch's thread count, once per step at most every ``interval_s``, to the CPUs other processes leave.

    Args:
        max_threads: the count when the machine is otherwise idle (the CPUs this process may use).
        interval_s: seconds between readings.
        clock, busy_seconds, own_seconds: where time and CPU use are read (tests pass their own).

    Attributes:
        threads: the count set now. changes: how many times it changed.
    """

    def __init__(self, max_threads: int, interval_s: float = INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic,
                 busy_seconds: Optional[Callable[[], float]] = None,
                 own_seconds: Callable[[], float] = own_cpu_seconds) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(max_threads))
        self.max_threads, self.interval_s = max_threads, interval_s
        self._clock, self._own = clock, own_seconds
        self._busy = busy_seconds or (lambda: proc_stat_busy_seconds(cpus))
        self._last: Tuple[float, float, float] = (clock(), self._busy(), own_seconds())
        self.threads, self.changes = torch.get_num_threads(), 0
        # Give the count back when the engine goes, so that later work in the process gets the machine's default.
        self._finalizer = weakref.finalize(self, torch.set_num_threads, self.threads)

    def others_cpus(self) -> Optional[float]:
        """CPUs' worth of time other processes used since the last reading; ``None`` before ``interval_s``."""
        now = self._clock()
        then, busy0, own0 = self._last
        if now - then < self.interval_s:
            return None
        busy, own = self._busy(), self._own()
        self._last = (now, busy, own)
        return max(0.0, (busy - busy0) - (own - own0)) / (now - then)

    def update(self) -> int:
        """Read the load when due and set torch's thread count; returns the count for this step."""
        others = self.others_cpus()
        if others is not None:
            # Half a CPU used by others counts as taken: the thread sharing it would make every barrier wait.
            target = max(1, self.max_threads - int(others + 0.5))
            if target != self.threads:
                torch.set_num_threads(target)
                self.threads, self.changes = target, self.changes + 1
        return self.threads

    def close(self) -> None:
        """Give torch its count from before (also done when the governor is collected)."""
        self._finalizer()


def governor_for_this_process() -> Optional[CpuThreadGovernor]:
    """A governor when nobody chose a thread count (see the module's docstring), else ``None``."""
    from minivllm import envs

    if not envs.MINIVLLM_CPU_THREADS_AUTO or os.environ.get("OMP_NUM_THREADS"):
        return None
    if not hasattr(os, "sched_getaffinity") or not os.path.exists("/proc/stat"):
        return None
    cpus = len(os.sched_getaffinity(0))
    if cpus < 2 or torch.get_num_threads() != cpus:
        return None
    return CpuThreadGovernor(cpus)

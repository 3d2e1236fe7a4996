"""How many threads a CPU step runs on: the CPUs this process may use, less the ones other processes keep busy.

minivllm only. vLLM 0.32's CPU build fixes its thread count once, when a worker is started: ``OMP_NUM_THREADS`` and
the OpenMP places are set from ``VLLM_CPU_OMP_THREADS_BIND`` (default ``auto``: one CPU per physical core of the
rank's NUMA node, less the reserved ones; `_parse_omp_threads_bind_env
<https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/utils/ompmultiprocessing.py#L122>`_), and the worker then turns
``torch.set_num_threads`` into a no-op (`skip_set_num_threads
<https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/v1/worker/cpu_worker.py#L139>`_). Every parallel region of
a step (a matrix product, an attention kernel) splits its work evenly over the threads and ends at a barrier, so when
another process holds one of the CPUs, each region waits for the thread that shares that CPU, and a 2-core machine runs
slower with two threads than with one: on the AVX-512 class, 170.4 output tok/s idle fell to 49.3 with two threads
and a busy second core, and held at 110.7 with one (``minivllm/bench/OPTIMISATIONS.md``, issue 27).

minivllm's float32 products and decode attention, most of a step's time, need not wait so: the calling thread can redo
an item that a descheduled helper thread holds (``csrc/thread_pool.h``). The governor gives them every CPU of the
process (``custom_ops.set_redoable_threads``), so while it has lowered torch's count they run on helper threads of
their own and keep the time a busy CPU has left, and its count applies to the rest, PyTorch's operators and minivllm's
other kernels: with a busy second core, the 32-request benchmark read 118.7 and 121.2 output tok/s against 98.6 and
99.4 with every kernel on one thread, on the AVX-512 class (OPTIMISATIONS.md, "Kernels that do not wait for a
descheduled thread"). While torch's count is one, the governor also keeps the helpers off the CPU of the thread that
runs the step (``custom_ops.set_helper_cpus``): with a loop pinned to the other CPU, the OS had moved the helper onto
the step thread's CPU, away from the loop, where it took that thread's time; kept off it, the same benchmark read
120.5 and 122.9 against 103.3 and 106.4 in alternating runs (OPTIMISATIONS.md, "The step's CPU and the helpers'
CPUs").

:class:`CpuThreadGovernor` reads at the end of each step how much CPU time the machine's other processes used on this
process's CPUs (``/proc/stat`` less this process's own time, ``os.times``; time stolen by the hypervisor counts as used)
and, every half second of stepping at most, sets the thread count of the thread that runs the step
(``torch.set_num_threads``) to the CPUs left, at least one: it gives up a thread when others use half a CPU or more, and
takes it back when they leave more than 0.7 of it free, so a load near the line does not flip it every reading. It
counts only time in which the engine was stepping: a pause of more than ``IDLE_GAP_S`` between two steps (``step_done``
marks a step's end) is left out, and stretches of steps add up to a reading, since what other processes did while the
engine sat idle did not compete with a step and may be over (``bench serve`` runs two servers by turns: counting the
other one's run put this one on one thread for its next burst, whose first tokens then came after 3.6 s instead of 1.8).
What others used during such a pause may only give a thread back (a load that ended while the engine sat idle). It is on
only when nobody chose a thread count: the engine's worker builds one when torch's count at start-up equals the CPUs
this process may run on (on a machine with SMT, where torch's default is the physical cores, it therefore stays off),
``OMP_NUM_THREADS`` is unset and ``MINIVLLM_CPU_THREADS_AUTO`` is not ``0`` (``python -m minivllm bench --threads N``
sets it to ``0``). A ``torch.set_num_threads`` of the user's own while an engine with a governor runs is overridden at
its next step. minivllm's own kernels give the same bits for any thread count (each output is summed by one thread);
oneDNN's and MKL's products need not, though SmolLM2's float32 logits were bit-identical with one thread and two in
every step of a mixed run checked on the AVX-512 class.
"""

from __future__ import annotations

import os
import time
import weakref
from typing import Callable, List, Optional, Tuple

import torch

from minivllm import custom_ops

#: Seconds of stepping between two decisions; a step in between keeps the last decision.
INTERVAL_S = 0.5
#: A pause between two steps longer than this (seconds) is idle time: it ends a stretch of stepping.
IDLE_GAP_S = 0.05

#: One reading: (clock seconds, busy CPU seconds of every process on this process's CPUs, this process's CPU seconds).
Reading = Tuple[float, float, float]


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
            if not line.startswith("cpu"):
                break  # the per-CPU lines come first; the rest (the long "intr" line) is not needed
            parts = line.split()
            if parts[0] in wanted:
                values = [int(v) for v in parts[1:9]]  # user nice system idle iowait irq softirq steal
                busy += sum(values) - values[3] - values[4]
    return busy / ticks


def process_cpus() -> List[int]:
    """The CPUs this process may run on (its affinity mask; every CPU where the OS has none to report)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def thread_cpu() -> int:
    """The CPU the calling thread runs on now (``/proc/thread-self/stat``'s ``processor`` field).

    Raises:
        OSError: no ``/proc/thread-self`` (not Linux, or Linux before 3.17).
    """
    with open("/proc/thread-self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


def own_cpu_seconds() -> float:
    """CPU seconds this process has used, all its threads (``os.times``)."""
    t = os.times()
    return t.user + t.system


class CpuThreadGovernor:
    """Sets torch's thread count before each step to the CPUs other processes leave, as decided after every
    ``interval_s`` of stepping (and, after a pause, possibly raised: ``update``).

    Args:
        max_threads: the count when the machine is otherwise idle (the CPUs this process may use).
        interval_s: seconds of stepping between two decisions.
        clock, busy_seconds, own_seconds: where time and CPU use are read (tests pass their own).
        step_thread_cpu: where the CPU of the thread that runs the step is read (tests pass their own).

    Attributes:
        threads: the count the last reading decided. changes: how many times a count was set.

    Raises:
        ValueError: ``max_threads < 1`` or ``interval_s <= 0``.
    """

    def __init__(self, max_threads: int, interval_s: float = INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic,
                 busy_seconds: Optional[Callable[[], float]] = None,
                 own_seconds: Callable[[], float] = own_cpu_seconds,
                 step_thread_cpu: Callable[[], int] = thread_cpu) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        cpus = process_cpus()
        self.max_threads, self.interval_s = max_threads, interval_s
        self._clock, self._own = clock, own_seconds
        self._busy = busy_seconds or (lambda: proc_stat_busy_seconds(cpus))
        # Counting starts at the first step, not now: the time until then (compiling the kernels in a child process,
        # an idle engine) says nothing about the load the steps will meet.
        self._stretch: Optional[Reading] = None  # the start of the current stretch of steps
        self._end: Optional[Reading] = None  # the end of the last step, until the next one starts
        self._stepping_s = self._others_s = 0.0  # stepping seconds since the last decision, others' CPU seconds in them
        self._pause_others: Optional[float] = None  # CPUs others used in the pause before this step, if there was one
        self.threads, self.changes = torch.get_num_threads(), 0
        self._cpus, self._step_cpu = cpus, step_thread_cpu
        # The CPUs this governor gave the kernels' helpers, else None; a list, so that the finalizer sees it.
        self._helpers: List[Optional[List[int]]] = [None]
        # Give the count back when the engine goes, so that later work in the process gets the machine's default.
        self._finalizer = weakref.finalize(self, _give_back, self.threads, self._helpers, cpus)

    def _read(self) -> Reading:
        return self._clock(), self._busy(), self._own()

    @staticmethod
    def _others_between(a: Reading, b: Reading) -> float:
        """CPU seconds other processes used on this process's CPUs between readings ``a`` and ``b``, signed: the
        clock-tick rounding of ``/proc/stat`` can make one stretch read below zero, and clamping each stretch would
        only ever add to the sum (the sum is clamped where it is used)."""
        return (b[1] - a[1]) - (b[2] - a[2])

    def _count(self, a: Reading, b: Reading) -> None:
        self._stepping_s += b[0] - a[0]
        self._others_s += self._others_between(a, b)

    def _higher(self, others: float) -> int:
        """The count when ``others`` CPUs are used by other processes, for giving a thread back: only with 0.7 of a
        CPU free, so that a load near the line does not flip the count."""
        return max(1, self.max_threads - int(max(others, 0.0) + 0.7))

    def others_cpus(self) -> Optional[float]:
        """CPUs' worth of time other processes used while this engine was stepping, over the stepping time since
        the last decision, once that reaches ``interval_s`` (one long step can make it longer); ``None`` before, and
        at the first step (which starts the count).

        Stepping time is made of stretches of steps with pauses of at most ``IDLE_GAP_S`` between them: a longer
        pause ends a stretch at the last ``step_done`` and the next stretch starts here, so what other processes did
        while the engine sat idle is not counted as load met by a step, and short bursts of steps add up until a
        decision is due. What others used in that pause is kept (``_pause_others``) for ``update``, which may only
        give threads back on it; when it does, the stretches before the pause are dropped, as the load they met has
        gone.
        """
        now = self._clock()
        self._pause_others = None
        if self._stretch is None:
            self._stretch, self._end = self._read(), None
            return None
        if self._end is not None and now - self._end[0] > IDLE_GAP_S:
            start = self._read()
            self._pause_others = max(0.0, self._others_between(self._end, start)) / max(start[0] - self._end[0], 1e-9)
            if self._higher(self._pause_others) > self.threads:
                self._stepping_s = self._others_s = 0.0
            else:
                self._count(self._stretch, self._end)
            self._stretch = start
        self._end = None
        if self._stepping_s + (now - self._stretch[0]) < self.interval_s:
            return None
        reading = self._read()
        self._count(self._stretch, reading)
        self._stretch = reading
        others = max(0.0, self._others_s) / max(self._stepping_s, 1e-9)
        self._stepping_s = self._others_s = 0.0
        return others

    def update(self) -> int:
        """Read the load when due and set the thread count of the calling thread; returns the count for this step.

        A decision over ``interval_s`` of stepping may lower the count or raise it. After a pause, what other
        processes used during it may raise the count (a load that ended while the engine sat idle), never lower it
        (a load that came and went in the pause, such as another server's run, must not cost the next burst a
        thread; a load that goes on is counted once the steps have met it for ``interval_s``). torch's count
        belongs to the thread that sets it: a step run from another thread (an async server's) is given the count
        in force too.
        """
        others = self.others_cpus()
        current = torch.get_num_threads()
        target = self.threads
        if others is not None:
            lower = max(1, self.max_threads - int(others + 0.5))  # half a CPU used by others counts as taken
            target = lower if lower < target else max(target, self._higher(others))
        if self._pause_others is not None:
            target = max(target, self._higher(self._pause_others))
        self.threads = target
        self._place_helpers(target, decided=others is not None)
        if target != current:
            torch.set_num_threads(target)
            self.changes += 1
        # Every CPU for the kernels whose items do not wait for a descheduled thread (module doc); set at each step,
        # as the kernels may be loaded after the first one and another engine's governor may have closed since.
        custom_ops.set_redoable_threads(self.max_threads)
        return target

    def _place_helpers(self, threads: int, decided: bool) -> None:
        """While torch's count is one, keep the kernels' helper threads off the CPU that the thread running the step is
        on (``custom_ops.set_helper_cpus``), looked up again at each decision; at a count above one, and when the
        governor closes, set their list back to every CPU of the process (each helper takes it when it next wakes). Left
        to the OS, with a loop pinned to the second CPU of two, the step's thread waited 3.0-3.2 s for its CPU in 21 s
        runs of the 32-request benchmark: nothing of minivllm's but the helper could have been runnable there (the loop
        could not), so the OS had moved the helper onto it, away from the loop's CPU. With the helpers kept off it,
        0.07-0.20 s (OPTIMISATIONS.md, "The step's CPU and the helpers' CPUs"). The step's thread itself is not pinned:
        on a CPU that another process shares, the OS moves it, here to the CPU the helpers had, and the next decision
        gives them the other; a thread pinned for the step would pass its one-CPU mask to every thread it starts.
        minivllm only: vLLM 0.32 binds its OpenMP threads once, at start-up (``VLLM_CPU_OMP_THREADS_BIND``, read in
        `configure_omp_envs
        <https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/utils/ompmultiprocessing.py#L71>`_)."""
        if threads != 1 or len(self._cpus) < 2:
            _give_helpers_back(self._helpers, self._cpus)
            return
        if (self._helpers[0] is not None and not decided) or not custom_ops.loaded():
            return
        try:
            cpu = self._step_cpu()
        except (OSError, ValueError, IndexError):  # no /proc/thread-self, or one laid out otherwise
            return
        helpers = [c for c in self._cpus if c != cpu]
        # Against the kernels' list, not this governor's record of it: another engine's governor may have given the
        # helpers every CPU back since, and a forked child starts with an empty list.
        if helpers == custom_ops.helper_cpus():
            self._helpers[0] = helpers
            return
        try:
            if custom_ops.set_helper_cpus(helpers):
                self._helpers[0] = helpers
        except RuntimeError:  # a CPU number past the kernel's mask (CPU_SETSIZE, 1024): the helpers keep theirs
            pass

    def step_done(self) -> None:
        """Mark the end of a step with a reading (``/proc/stat``: 20-40 us on a 2-core EPYC, against steps of 15 ms
        and more): the pause until the next ``update`` tells whether the engine sat idle in between, and the reading
        then ends the stretch of steps."""
        self._end = self._read()

    def close(self) -> None:
        """Give torch its count from before, and the kernels' helpers every CPU if this governor had given them fewer
        (also done when the governor is collected)."""
        self._finalizer()


def _give_helpers_back(helpers: List[Optional[List[int]]], cpus: List[int]) -> None:
    """Every CPU of the process to the kernels' helpers, if this governor had given them fewer (``helpers[0]``)."""
    if helpers[0] is not None:
        custom_ops.set_helper_cpus(cpus)
        helpers[0] = None


def _give_back(threads: int, helpers: List[Optional[List[int]]], cpus: List[int]) -> None:
    _give_helpers_back(helpers, cpus)
    torch.set_num_threads(threads)
    custom_ops.set_redoable_threads(0)


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

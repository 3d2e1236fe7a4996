"""The CPU thread governor: fewer threads while other processes hold CPUs, all of them again when they stop."""

import gc
import os

import pytest
import torch

from minivllm import custom_ops
from minivllm.worker import cpu_threads
from minivllm.worker.cpu_threads import CpuThreadGovernor, governor_for_this_process, proc_stat_busy_seconds


class FakeMachine:
    """A clock, the machine's busy CPU seconds and this process's own, advanced by hand."""

    def __init__(self):
        self.now, self.busy, self.own = 100.0, 5000.0, 40.0

    def run(self, seconds, ours, others):
        """``seconds`` pass while this process uses ``ours`` CPUs and other processes ``others``."""
        self.now += seconds
        self.own += ours * seconds
        self.busy += (ours + others) * seconds


@pytest.fixture(autouse=True)
def close_governors():
    """A governor closes when it is collected, and closing sets the process's thread counts: collected during a later
    test (another module's, in the same worker), it would change that test's counts under it. Each test's governors
    are collected here, at its end."""
    yield
    gc.collect()


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    gc.collect()  # first: a governor collected afterwards would set its own count from before (close_governors)
    torch.set_num_threads(before)


def make(m, max_threads=2, first_reading=True):
    """A governor over ``m``; with ``first_reading``, one that has taken its first reading (an engine's first step)."""
    g = CpuThreadGovernor(max_threads, interval_s=0.5, clock=lambda: m.now, busy_seconds=lambda: m.busy,
                          own_seconds=lambda: m.own)
    if first_reading:
        assert g.others_cpus() is None  # the first reading only sets the baseline
    return g


def test_a_busy_cpu_takes_a_thread_and_gives_it_back(restore_threads):
    torch.set_num_threads(2)
    m = FakeMachine()
    g = make(m)
    m.run(1.0, ours=2.0, others=0.0)
    assert g.update() == 2 and torch.get_num_threads() == 2
    m.run(1.0, ours=1.5, others=0.5)  # another job shares a core with one of our threads
    assert g.update() == 1 and torch.get_num_threads() == 1
    m.run(1.0, ours=1.0, others=1.0)  # it keeps its core: we stay on one thread
    assert g.update() == 1
    m.run(1.0, ours=1.0, others=0.1)  # it stopped
    assert g.update() == 2 and torch.get_num_threads() == 2
    assert g.changes == 2


def test_a_load_near_the_line_does_not_flip_the_count(restore_threads):
    torch.set_num_threads(2)
    m = FakeMachine()
    g = make(m)
    m.run(1.0, ours=1.5, others=0.55)
    assert g.update() == 1
    for others in (0.45, 0.35, 0.5, 0.4):  # at one thread, 0.3-0.5 CPU used by others: not enough room to go back
        m.run(1.0, ours=1.0, others=others)
        assert g.update() == 1
    m.run(1.0, ours=1.0, others=0.25)
    assert g.update() == 2 and g.changes == 2


def test_time_before_the_first_step_is_not_counted(restore_threads):
    torch.set_num_threads(2)
    m = FakeMachine()
    g = make(m, first_reading=False)
    m.run(30.0, ours=0.0, others=2.0)  # e.g. the kernels compiled by a child process before the first step
    assert g.update() == 2  # first step: the baseline
    m.run(1.0, ours=2.0, others=0.0)
    assert g.update() == 2 and g.changes == 0


def test_a_load_met_while_the_engine_was_idle_is_not_counted(restore_threads):
    """Two servers benchmarked by turns: the other one's run, while this engine sat idle, says nothing about the
    next burst of steps; a load that goes on is counted once the steps have run for a reading's interval."""
    torch.set_num_threads(2)
    m = FakeMachine()
    g = make(m)
    m.run(1.0, ours=2.0, others=0.0)
    assert g.update() == 2
    m.run(0.01, ours=2.0, others=0.0)
    g.step_done()
    m.run(8.0, ours=0.0, others=2.0)  # idle while another job used both CPUs, then it ended
    assert g.update() == 2 and g.changes == 0  # the window over the pause is dropped
    m.run(1.0, ours=2.0, others=0.0)
    assert g.update() == 2 and g.changes == 0
    g.step_done()
    m.run(8.0, ours=0.0, others=1.0)  # idle again while a job starts that keeps a CPU busy
    assert g.update() == 2
    m.run(0.6, ours=1.5, others=1.0)  # the steps meet it
    assert g.update() == 1 and g.changes == 1


def test_short_pauses_between_steps_are_part_of_the_window(restore_threads):
    torch.set_num_threads(2)
    m = FakeMachine()
    g = make(m)
    for _ in range(10):  # 10 steps of 0.09 s, 0.01 s apart, while another job holds a CPU
        m.run(0.09, ours=1.0, others=1.0)
        g.step_done()
        m.run(0.01, ours=0.0, others=1.0)
        g.update()
    assert g.threads == 1 and g.changes == 1


def test_short_bursts_of_steps_add_up_to_a_reading(restore_threads):
    """A server at a low rate: bursts of 10 steps of 40 ms, 1 s idle between, beside a job that keeps a CPU busy
    all along. The bursts' stepping time adds up, so the load is met and counted within two bursts."""
    torch.set_num_threads(2)
    m = FakeMachine()
    g = make(m)
    for burst in range(3):
        for _ in range(10):
            g.update()
            m.run(0.04, ours=1.5, others=1.0)
            g.step_done()
        m.run(1.0, ours=0.0, others=1.0)
        if burst >= 1:
            assert g.threads == 1
    assert g.changes == 1


def test_a_load_that_ended_in_a_pause_gives_the_thread_back_at_once(restore_threads):
    torch.set_num_threads(2)
    m = FakeMachine()
    g = make(m)
    m.run(1.0, ours=1.0, others=1.0)
    assert g.update() == 1
    m.run(0.1, ours=1.0, others=1.0)
    g.step_done()
    m.run(3.0, ours=0.0, others=0.05)  # the other job ended while the engine sat idle
    assert g.update() == 2 and g.changes == 2


def test_a_decision_due_after_a_pause_still_hears_the_pause(restore_threads):
    """0.52 s of steps beside a lasting load, then a pause in which the load ended: the decision that falls due at
    the next step must not take a thread for a load that has gone."""
    torch.set_num_threads(2)
    m = FakeMachine()
    g = make(m)
    m.run(0.52, ours=1.5, others=1.0)
    g.step_done()
    m.run(3.0, ours=0.0, others=0.0)
    assert g.update() == 2 and g.changes == 0


def test_steps_before_a_pause_that_gave_a_thread_back_are_dropped(restore_threads):
    torch.set_num_threads(2)
    m = FakeMachine()
    g = make(m)
    m.run(0.6, ours=1.0, others=1.0)
    assert g.update() == 1
    m.run(0.32, ours=1.0, others=1.0)  # more steps beside the load, not yet a decision
    g.step_done()
    m.run(2.0, ours=0.0, others=0.0)  # the load ends in a pause: the thread comes back
    assert g.update() == 2
    m.run(0.2, ours=2.0, others=0.0)  # with the 0.32 s before the pause, the load would read 0.6 CPU: 1 thread again
    g.step_done()
    assert g.update() == 2 and g.changes == 2


def test_a_pause_longer_than_the_idle_gap_is_left_out(restore_threads):
    """A pause of 0.2 s (over IDLE_GAP_S, under a reading's interval) while another job used both CPUs."""
    torch.set_num_threads(2)
    m = FakeMachine()
    g = make(m)
    m.run(0.3, ours=2.0, others=0.0)
    g.step_done()
    m.run(0.2, ours=0.0, others=2.0)
    assert g.update() == 2
    m.run(0.3, ours=2.0, others=0.0)
    g.step_done()
    m.run(0.01, ours=0.0, others=0.0)
    assert g.update() == 2 and g.changes == 0


def test_a_thread_started_before_the_decision_gets_it(restore_threads):
    import threading

    torch.set_num_threads(2)
    m = FakeMachine()
    g = make(m)
    go, seen = threading.Event(), []

    def step():
        go.wait()
        seen.append((g.update(), torch.get_num_threads()))

    worker = threading.Thread(target=step)
    worker.start()
    m.run(1.0, ours=1.0, others=1.0)
    assert g.update() == 1
    go.set()
    worker.join()
    assert seen == [(1, 1)]


def test_a_step_from_another_thread_gets_the_decision(restore_threads):
    """torch's thread count is per thread: a step run from another thread (an async server's) is set too."""
    import threading

    torch.set_num_threads(2)
    m = FakeMachine()
    g = make(m)
    m.run(1.0, ours=1.0, others=1.0)
    assert g.update() == 1 and torch.get_num_threads() == 1
    seen = []
    worker = threading.Thread(target=lambda: seen.append((torch.get_num_threads(), g.update(),
                                                          torch.get_num_threads())))
    worker.start()
    worker.join()
    assert seen[0][1:] == (1, 1)


def test_light_background_use_keeps_every_thread(restore_threads):
    torch.set_num_threads(2)
    m = FakeMachine()
    g = make(m)
    m.run(1.0, ours=2.0, others=0.3)
    assert g.update() == 2 and g.changes == 0


def test_readings_wait_for_the_interval(restore_threads):
    torch.set_num_threads(2)
    m = FakeMachine()
    g = make(m)
    m.run(0.2, ours=1.0, others=1.0)
    assert g.update() == 2  # too soon: no reading, no change
    m.run(0.4, ours=1.0, others=1.0)
    assert g.update() == 1


def test_never_below_one_thread_and_closing_restores_the_count(restore_threads):
    torch.set_num_threads(4)
    m = FakeMachine()
    g = make(m, max_threads=4)
    m.run(1.0, ours=0.5, others=3.9)
    assert g.update() == 1 and torch.get_num_threads() == 1
    g.close()
    assert torch.get_num_threads() == 4


@pytest.mark.skipif(not custom_ops.load(), reason="the CPU kernels cannot be built here")
def test_the_redoable_kernels_keep_every_cpu_while_a_busy_one_takes_torchs_thread(restore_threads):
    """The products and decode attention do not wait for a descheduled thread (csrc/thread_pool.h): the governor
    leaves them every CPU when it lowers torch's count, and gives them back to torch's count when it closes."""
    torch.set_num_threads(2)
    m = FakeMachine()
    g = make(m)
    try:
        m.run(1.0, ours=1.5, others=0.5)
        assert g.update() == 1 and torch.get_num_threads() == 1
        assert custom_ops.redoable_threads() == 2
    finally:
        g.close()
    assert torch.get_num_threads() == 2
    torch.set_num_threads(1)
    assert custom_ops.redoable_threads() == 1  # following torch again


two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not custom_ops.load(),
                              reason="needs two CPUs and the CPU kernels")


@pytest.fixture(autouse=True)
def restore_helper_cpus():
    """Every governor here that lowers torch's count to one sets the helpers' CPUs: the next test gets them back."""
    before = custom_ops.helper_cpus()
    yield
    if custom_ops.helper_cpus() != before:
        custom_ops.set_helper_cpus(before or sorted(os.sched_getaffinity(0)))


class StepCpu:
    """The CPU the step's thread is on, as ``thread_cpu`` reports it, set by hand."""

    def __init__(self, cpu):
        self.cpu = cpu

    def __call__(self):
        return self.cpu


def placing(m, step_cpu):
    g = CpuThreadGovernor(2, interval_s=0.5, clock=lambda: m.now, busy_seconds=lambda: m.busy,
                          own_seconds=lambda: m.own, step_thread_cpu=step_cpu)
    g.others_cpus()
    return g


@two_cpus
def test_on_one_thread_the_helpers_keep_off_the_step_threads_cpu(restore_threads):
    """Left to the OS, a helper moves onto the step thread's CPU and takes its time: while torch's count is one, the
    helpers get the other CPUs, looked up again at each decision (the OS moves the step's thread off a CPU another
    process shares); the step's thread keeps its mask; a count above one, and closing, give the helpers every CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    torch.set_num_threads(2)
    m, step_cpu = FakeMachine(), StepCpu(cpus[0])
    g = placing(m, step_cpu)
    try:
        m.run(1.0, ours=2.0, others=0.0)
        before = custom_ops.helper_cpus()
        assert g.update() == 2 and custom_ops.helper_cpus() == before  # on two threads nothing is placed
        m.run(1.0, ours=1.5, others=0.5)
        assert g.update() == 1 and custom_ops.helper_cpus() == cpus[1:]
        assert os.sched_getaffinity(0) == set(cpus)
        step_cpu.cpu = cpus[1]  # the OS moved the step's thread
        m.run(0.1, ours=1.0, others=1.0)
        assert g.update() == 1 and custom_ops.helper_cpus() == cpus[1:]  # no decision yet
        m.run(1.0, ours=1.0, others=1.0)
        assert g.update() == 1 and custom_ops.helper_cpus() == [c for c in cpus if c != cpus[1]]
        m.run(1.0, ours=1.0, others=0.1)  # the job stopped
        assert g.update() == 2 and custom_ops.helper_cpus() == cpus
        m.run(1.0, ours=1.5, others=0.5)
        assert g.update() == 1 and custom_ops.helper_cpus() == [c for c in cpus if c != cpus[1]]
    finally:
        g.close()
    assert custom_ops.helper_cpus() == cpus and os.sched_getaffinity(0) == set(cpus)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_nothing_is_placed_without_the_kernels(restore_threads, monkeypatch):
    """Not loaded: no lookup, no list. Loaded later, or a list the kernels refuse: tried again at the next step."""
    calls, state = [], {"loaded": False}
    monkeypatch.setattr(custom_ops, "loaded", lambda: state["loaded"])
    monkeypatch.setattr(custom_ops, "helper_cpus", lambda: [])
    monkeypatch.setattr(custom_ops, "set_helper_cpus", lambda cpus: calls.append(cpus) or False)
    cpus = sorted(os.sched_getaffinity(0))
    torch.set_num_threads(2)
    m, step_cpu = FakeMachine(), StepCpu(cpus[0])
    g = placing(m, step_cpu)
    try:
        m.run(1.0, ours=1.5, others=0.5)
        assert g.update() == 1 and calls == []
        state["loaded"] = True
        m.run(0.1, ours=1.0, others=1.0)
        assert g.update() == 1 and calls == [cpus[1:]]  # set_helper_cpus said False: not placed
        m.run(0.1, ours=1.0, others=1.0)
        assert g.update() == 1 and len(calls) == 2
    finally:
        g.close()
    assert len(calls) == 2  # closing gives back only what was given


@two_cpus
def test_a_step_cpu_that_cannot_be_read_places_nothing(restore_threads):
    def unreadable():
        raise ValueError("a /proc laid out otherwise")

    cpus = sorted(os.sched_getaffinity(0))
    before = custom_ops.helper_cpus()
    torch.set_num_threads(2)
    m = FakeMachine()
    g = placing(m, unreadable)
    try:
        m.run(1.0, ours=1.5, others=0.5)
        assert g.update() == 1 and custom_ops.helper_cpus() == before
    finally:
        g.close()
    assert custom_ops.helper_cpus() == before and len(cpus) >= 2


@two_cpus
def test_a_second_governor_sets_its_list_again_after_the_first_closes(restore_threads):
    """The list is the process's: when another engine's governor gives the helpers every CPU back, this one's next
    decision keeps them off its step thread's CPU again."""
    cpus = sorted(os.sched_getaffinity(0))
    torch.set_num_threads(2)
    ma, mb = FakeMachine(), FakeMachine()
    a, b = placing(ma, StepCpu(cpus[0])), placing(mb, StepCpu(cpus[0]))
    try:
        for m, g in ((ma, a), (mb, b)):
            m.run(1.0, ours=1.5, others=0.5)
            assert g.update() == 1
        assert custom_ops.helper_cpus() == cpus[1:]
        a.close()
        assert custom_ops.helper_cpus() == cpus
        mb.run(1.0, ours=1.0, others=1.0)
        assert b.update() == 1 and custom_ops.helper_cpus() == cpus[1:]
    finally:
        a.close()
        b.close()


@two_cpus
def test_thread_cpu_is_the_cpu_this_thread_runs_on():
    cpus = sorted(os.sched_getaffinity(0))
    try:
        for cpu in (cpus[-1], cpus[0]):
            os.sched_setaffinity(0, {cpu})
            os.sched_yield()
            assert cpu_threads.thread_cpu() == cpu
    finally:
        os.sched_setaffinity(0, cpus)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="max_threads must be >= 1"):
        CpuThreadGovernor(0)
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        CpuThreadGovernor(2, interval_s=0)


def test_proc_stat_counts_all_but_idle_and_iowait(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  900 0 90 9000 9 0 0 0 0 0\n"
                    "cpu0 100 5 20 1000 50 3 2 7 0 0\n"
                    "cpu1 400 0 40 4000 0 0 0 0 0 0\n"
                    "intr 12345\n")
    ticks = os.sysconf("SC_CLK_TCK")
    assert proc_stat_busy_seconds([0], str(stat)) == pytest.approx((100 + 5 + 20 + 3 + 2 + 7) / ticks)
    assert proc_stat_busy_seconds([0, 1], str(stat)) == pytest.approx((137 + 440) / ticks)


def test_on_only_when_nobody_chose_a_thread_count(monkeypatch, restore_threads):
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("MINIVLLM_CPU_THREADS_AUTO", "1")
    torch.set_num_threads(cpus)
    g = governor_for_this_process()
    assert (g is not None) == (cpus >= 2)
    if g is not None:
        assert g.max_threads == cpus
        g.close()
    monkeypatch.setenv("MINIVLLM_CPU_THREADS_AUTO", "0")
    assert governor_for_this_process() is None
    monkeypatch.setenv("MINIVLLM_CPU_THREADS_AUTO", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert governor_for_this_process() is None
    monkeypatch.delenv("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    assert governor_for_this_process() is None


def test_the_worker_steps_through_the_governor(monkeypatch, restore_threads):
    """An engine on the CPU consults the governor once per step, and a shutdown gives the count back."""
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.sampling_params import SamplingParams

    calls, ends = [], []

    class Recording(CpuThreadGovernor):
        def update(self):
            calls.append(torch.get_num_threads())
            return super().update()

        def step_done(self):
            ends.append(len(calls))
            super().step_done()

    monkeypatch.setattr(cpu_threads, "governor_for_this_process", lambda: Recording(2))
    torch.set_num_threads(2)
    engine = LLMEngine("tiny", device="cpu", num_gpu_blocks=32)
    worker = engine.engine_core.model_executor.driver_worker
    assert isinstance(worker.cpu_threads, Recording)
    engine.add_request("a", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3, temperature=0))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert len(calls) == steps == 3
    assert ends == [1, 2, 3]  # each step's end is marked once, after its own update
    torch.set_num_threads(1)  # what a governor might have left
    engine.shutdown()
    assert worker.cpu_threads is None and torch.get_num_threads() == 2


@pytest.mark.parametrize("stage", ["execute_model", "sample_tokens"])
def test_a_step_that_raises_still_marks_its_end(monkeypatch, restore_threads, stage):
    """A step whose forward pass or sampling raises has ended as well: its end is marked, so that the pause after it
    is not counted as stepping time."""
    from minivllm.engine.llm_engine import LLMEngine

    ends = []

    class Recording(CpuThreadGovernor):
        def step_done(self):
            ends.append(stage)
            super().step_done()

    monkeypatch.setattr(cpu_threads, "governor_for_this_process", lambda: Recording(2))
    torch.set_num_threads(2)
    engine = LLMEngine("tiny", device="cpu", num_gpu_blocks=32)
    worker = engine.engine_core.model_executor.driver_worker

    def boom(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(worker.model_runner, stage, boom)
    with pytest.raises(RuntimeError, match="boom"):
        getattr(worker, stage)(None)
    assert ends == [stage]
    engine.shutdown()

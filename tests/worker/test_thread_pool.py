"""Redoable work items (``minivllm/csrc/thread_pool.h``): the same bits on OpenMP's threads and on the kernels' own
helpers, at any thread count; items redone when a helper is descheduled; a forked child that gets helpers of its
own."""

import json
import multiprocessing
import os
import subprocess
import sys
import time

import pytest
import torch

from minivllm import custom_ops

pytestmark = pytest.mark.skipif(not custom_ops.load(), reason="the CPU kernels cannot be built here")

needs_gemm = pytest.mark.skipif(not custom_ops.packed_gemm_available(), reason="no AVX2 and FMA on this CPU")


class threads:
    """torch's and the redoable kernels' thread counts for a block, given back afterwards. A redoable count above
    torch's sends ``packed_gemm`` and ``paged_attention_decode`` to the helpers, else to ``at::parallel_for``."""

    def __init__(self, torch_threads: int, redoable: int = 0) -> None:
        self.torch_threads, self.redoable = torch_threads, redoable

    def __enter__(self):
        self.before = torch.get_num_threads()
        torch.set_num_threads(self.torch_threads)
        custom_ops.set_redoable_threads(self.redoable)

    def __exit__(self, *exc):
        torch.set_num_threads(self.before)
        custom_ops.set_redoable_threads(0)


def _until_a_helper_commits(call, seconds: float = 30.0) -> bool:
    """``call()`` again and again until a helper has committed an item, for up to ``seconds``: on a machine whose
    CPUs other work keeps busy (CI's two test workers), a helper may wait milliseconds for a CPU, longer than a few
    hundred small calls take."""
    helped, deadline = custom_ops.helped_items(), time.monotonic() + seconds
    while custom_ops.helped_items() == helped and time.monotonic() < deadline:
        call()
    return custom_ops.helped_items() > helped


def _decode_inputs(g, num_reqs=9, block_size=16, kv_heads=3, group=3, head_dim=64):
    lens = torch.randint(1, 200, (num_reqs,), generator=g)
    max_blocks = int((lens.max() + block_size - 1) // block_size)
    num_blocks = num_reqs * max_blocks + 1
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g)
    bt = torch.randperm(num_blocks - 1, generator=g)[: num_reqs * max_blocks].view(num_reqs, max_blocks)
    q = torch.randn(num_reqs, kv_heads * group, head_dim, generator=g)
    return q, kv, bt.contiguous(), lens, torch.arange(num_reqs)


def _decode(q, kv, bt, lens, rows):
    out = torch.empty_like(q)
    custom_ops.paged_attention_decode(out, q, kv, bt, lens, rows, 0.125)
    return out


@needs_gemm
@pytest.mark.parametrize("rows", [1, 3, 20, 300])
def test_packed_gemm_same_bits_at_every_thread_count(rows):
    """Items are runs of panels by blocks of up to 128 rows (300 rows: 128 + 128 + 44), each computed by one thread:
    the result cannot depend on how many threads shared them, or which."""
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(1000, 576, generator=g), torch.randn(rows, 576, generator=g)
    packed = custom_ops.pack_gemm_weight(w)
    results = {}
    for t, r in [(1, 0), (2, 0), (3, 0), (1, 2), (1, 3)]:
        with threads(t, r):
            assert custom_ops.redoable_threads() == (r or t)
            results[t, r] = custom_ops.packed_gemm(x, packed, 1000)
            if r:  # let the helpers take items: through scratch and commit (rows == 1: the two-panel path)

                def same():
                    assert torch.equal(custom_ops.packed_gemm(x, packed, 1000), results[t, r])

                assert _until_a_helper_commits(same)
    base = results[1, 0]
    torch.testing.assert_close(base.double(), x.double() @ w.double().T, atol=1e-3, rtol=1e-5)
    assert all(torch.equal(v, base) for v in results.values())


def test_decode_attention_same_bits_at_every_thread_count():
    g = torch.Generator().manual_seed(0)
    for num_reqs in (2, 24):  # one item per (request, KV head), then one per request
        q, kv, bt, lens, rows = _decode_inputs(g, num_reqs=num_reqs)
        out = {}
        for t, r in [(1, 0), (2, 0), (3, 0), (1, 2), (1, 3), (2, 3)]:
            with threads(t, r):
                out[t, r] = _decode(q, kv, bt, lens, rows)
        assert all(torch.equal(v, out[1, 0]) for v in out.values())


def _busy_loop_on(cpu: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])


@needs_gemm
@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs: one for a busy loop, one for this process's other thread")
def test_items_a_descheduled_helper_holds_are_redone_and_the_results_stay_exact():
    """A busy loop on one CPU takes it from the helper thread for milliseconds at a time, mid-item: the caller redoes
    such items (its own result is the one kept) and the helper's late result is dropped. Every product must still
    equal the one-thread product, bit for bit."""
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(3072, 576, generator=g), torch.randn(20, 576, generator=g)
    packed = custom_ops.pack_gemm_weight(w)
    q, kv, bt, lens, rows = _decode_inputs(g, num_reqs=24)
    with threads(1):
        want_gemm, want_attn = custom_ops.packed_gemm(x, packed, 3072), _decode(q, kv, bt, lens, rows)
    before = custom_ops.redone_items()
    loop = _busy_loop_on(sorted(os.sched_getaffinity(0))[-1])
    try:
        deadline = time.monotonic() + 20
        calls = 0
        with threads(1, 2):
            while time.monotonic() < deadline and (custom_ops.redone_items() == before or calls < 200):
                assert torch.equal(custom_ops.packed_gemm(x, packed, 3072), want_gemm)
                assert torch.equal(_decode(q, kv, bt, lens, rows), want_attn)
                calls += 1
    finally:
        loop.kill()
        loop.wait()
    assert custom_ops.redone_items() > before, f"no item was redone in {calls} calls"


def _child_product(queue, x, packed, want):
    cpus = custom_ops.helper_cpus()  # the parent's list is not the child's: its helpers are new
    torch.set_num_threads(1)
    custom_ops.set_redoable_threads(2)
    equal = [True]

    def same():
        equal[0] &= torch.equal(custom_ops.packed_gemm(x, packed, want.shape[1]), want)

    helped = _until_a_helper_commits(same)  # a helper of the child's own
    queue.put((equal[0], helped, cpus))


@needs_gemm
def test_a_forked_child_runs_the_kernels_on_threads_of_its_own():
    """The child of a fork has none of the parent's helper threads: its pool is a new one (pthread_atfork), so a
    region there neither waits for helpers that do not exist nor deadlocks on a lock held at the fork. (The child
    does not run OpenMP: a region of PyTorch's GNU OpenMP in a child forked after the parent ran one hangs.)"""
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(500, 64, generator=g), torch.randn(40, 64, generator=g)
    packed = custom_ops.pack_gemm_weight(w)
    want = custom_ops.packed_gemm(x, packed, 500)
    with threads(1, 2):
        assert torch.equal(custom_ops.packed_gemm(x, packed, 500), want)  # the parent's helpers exist now
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    before = custom_ops.helper_cpus()
    custom_ops.set_helper_cpus(sorted(os.sched_getaffinity(0)))
    try:
        child = ctx.Process(target=_child_product, args=(queue, x, packed, want))
        child.start()
        child.join(60)
    finally:
        custom_ops.set_helper_cpus(before or sorted(os.sched_getaffinity(0)))
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == 0
    assert queue.get(timeout=5) == (True, True, [])


@needs_gemm
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_helpers_run_on_the_cpus_they_are_given():
    """``set_helper_cpus``: each helper takes the new CPUs before its next item (the governor keeps them off the
    step thread's CPU); the thread that calls the kernels keeps its own."""
    cpus = sorted(os.sched_getaffinity(0))
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(3072, 576, generator=g), torch.randn(20, 576, generator=g)
    packed = custom_ops.pack_gemm_weight(w)

    def run_until_a_helper_commits():
        if not _until_a_helper_commits(lambda: custom_ops.packed_gemm(x, packed, 3072)):
            pytest.fail("no helper committed an item")

    def masks():
        """The helpers' CPU masks (the threads the pool names ``minivllm-helper``)."""
        out = []
        for t in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{t}/comm") as f:
                    if f.read().strip() == "minivllm-helper":
                        out.append(os.sched_getaffinity(int(t)))
            except OSError:  # a thread that ended meanwhile
                pass
        return out

    def run_until(done):
        """Products until ``done()``: every helper (earlier tests may have started more than one) applies the list
        when it next wakes for a call, whether or not it gets an item there."""
        for _ in range(20):
            run_until_a_helper_commits()
            if done():
                return True
        return False

    before = custom_ops.helper_cpus()
    try:
        with threads(1, 2):
            run_until_a_helper_commits()
            custom_ops.set_helper_cpus([cpus[-1]])
            assert run_until(lambda: masks() and all(m == {cpus[-1]} for m in masks())), masks()
            assert os.sched_getaffinity(0) == set(cpus)
            custom_ops.set_helper_cpus(cpus)
            assert run_until(lambda: all(m == set(cpus) for m in masks())), masks()
    finally:
        custom_ops.set_helper_cpus(before or cpus)


_FIRST_HELPERS = """
import json, os, time, torch
from minivllm import custom_ops
cpus = sorted(os.sched_getaffinity(0))
custom_ops.load()
custom_ops.set_helper_cpus([cpus[-1]])  # before any helper exists
torch.set_num_threads(1)
custom_ops.set_redoable_threads(2)
packed, x = custom_ops.pack_gemm_weight(torch.randn(3072, 576)), torch.randn(20, 576)
deadline = time.monotonic() + 30
while not custom_ops.helped_items() and time.monotonic() < deadline:
    custom_ops.packed_gemm(x, packed, 3072)
masks = []
for t in os.listdir("/proc/self/task"):
    try:
        with open(f"/proc/self/task/{t}/comm") as f:
            if f.read().strip() == "minivllm-helper":
                masks.append(sorted(os.sched_getaffinity(int(t))))
    except OSError:
        pass
print(json.dumps([masks, cpus[-1]]))
"""


@needs_gemm
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_helpers_started_after_the_list_is_set_take_it_at_once():
    """The governor sets the list before the first call that starts the helpers: a helper started after the list
    was set takes it too (it has seen no version of the list yet)."""
    out = subprocess.run([sys.executable, "-c", _FIRST_HELPERS], capture_output=True, text=True, timeout=120,
                         check=True).stdout.strip().splitlines()[-1]
    masks, cpu = json.loads(out)
    assert masks == [[cpu]]


def test_set_helper_cpus_refuses_cpus_outside_the_mask_range():
    with pytest.raises(ValueError, match="cpus must be >= 0"):
        custom_ops.set_helper_cpus([0, -1])
    before = custom_ops.helper_cpus()
    with pytest.raises(RuntimeError, match="within 0..1023"):
        custom_ops.set_helper_cpus([1024])
    assert custom_ops.helper_cpus() == before

"""``drain_gloo_worker`` (minivllm/distributed/parallel_state.py): gloo's worker thread may let go of a
collective's tensors after the caller's ``wait()``, and under torch 2.13 that release takes the GIL, so a process
that exits while the worker still holds one can abort at shutdown (std::terminate). This test makes the hazard
happen on purpose, with two real gloo ranks, and checks that the drain ends it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from minivllm.executor.multiproc_executor import get_open_port

_RANK = r'''
import json, os, sys, time, weakref
import torch, torch.distributed as dist
from minivllm.distributed import parallel_state

rank, port = int(sys.argv[1]), sys.argv[2]
parallel_state.init_distributed_environment(2, rank, f"tcp://127.0.0.1:{port}", "gloo")
parallel_state.initialize_model_parallel(2)
def runloops():  # gloo's worker threads (torch names them when they start)
    return sum(open(f"/proc/self/task/{t}/comm").read().strip() == "pt_gloo_runloop"
               for t in os.listdir("/proc/self/task"))
if rank == 1:
    time.sleep(1.0)  # rank 0's collective cannot finish before this
    dist.all_reduce(torch.ones(3))
    done = time.monotonic()  # the same clock in both processes
    print(json.dumps({"drained": parallel_state.drain_gloo_worker(), "collective_done": done}))
    parallel_state.destroy_model_parallel()
    sys.exit(0)
# Rank 0: hand gloo a tensor and drop every reference of ours before the collective can finish, so that gloo's
# worker holds the last one. Then keep the GIL (pure Python, a 30 s switch interval) while the collective finishes:
# the worker cannot let go of the tensor without the GIL.
sys.setswitchinterval(30.0)
x = torch.ones(3)
alive = weakref.ref(x)
dist.all_reduce(x, async_op=True)
del x
t0 = time.monotonic()
while time.monotonic() - t0 < 2.5:
    pass
spin_end = time.monotonic()
held_before = alive() is not None
drained = parallel_state.drain_gloo_worker()
held_after = alive() is not None
# Only now anything that reads a file: file I/O lets go of the GIL.
print(json.dumps({"runloops": runloops(), "backend": dist.get_backend(), "held_before": held_before,
                  "drained": drained, "held_after": held_after, "spin_end": spin_end}))
parallel_state.destroy_model_parallel()
'''


def test_drain_waits_until_gloo_has_let_go_of_every_tensor(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    port = str(get_open_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path) for r in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    rank0 = json.loads(outs[0][0].strip().splitlines()[-1])
    rank1 = json.loads(outs[1][0].strip().splitlines()[-1])
    # One worker thread, not torch's default two: the drain's ordering argument needs it.
    assert rank0["runloops"] == 1 and rank0["backend"] == "minivllm_gloo"
    # The hazard happened: the collective was over before rank 0 looked (rank 1's clock says so), and gloo's
    # worker still held the tensor, waiting for the GIL...
    assert rank1["collective_done"] < rank0["spin_end"] and rank0["held_before"] is True
    # ...and the drain returned only after it had let go.
    assert rank0["drained"] is True and rank0["held_after"] is False
    assert rank1["drained"] is True

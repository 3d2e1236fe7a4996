"""How the Triton test files run their kernel tests under Triton's interpreter, in a child pytest process.

Why a child process: ``TRITON_INTERPRET`` is read by every ``@triton.jit`` decorator, and ``triton.language``'s own
helpers (``tl.max``, ``tl.sum``, ``tl.cdiv``) are ``@triton.jit`` functions decorated when triton is first
imported; setting the variable later fails ("Cannot call @triton.jit'd outside of the scope of a kernel", or an
assertion in triton's later imports), and ``torch._dynamo`` imports triton too (through transformers' models, for
instance). Setting it at the top of a test file would work only if nothing imported triton earlier in the pytest
process, and would then stay on for every later test and every process they start (notebook kernels under nbval
included). So each Triton test file runs itself in a child process that starts with ``TRITON_INTERPRET=1``; its
kernel tests run there and skip in the parent, saying so. To run them directly:
``TRITON_INTERPRET=1 python -m pytest tests/worker/test_triton_kernels.py``.
"""

import os
import re
import subprocess
import sys

import pytest


def where_it_runs(interpreted_here: bool, outside_the_interpreter: tuple):
    """An autouse fixture: tests named in ``outside_the_interpreter`` run only in the parent, all others only
    under the interpreter (in the child)."""

    @pytest.fixture(autouse=True)
    def _where_it_runs(request):
        if request.node.name in outside_the_interpreter:
            if interpreted_here:
                pytest.skip("runs in the parent process, without TRITON_INTERPRET")
        elif not interpreted_here:
            pytest.skip("runs under TRITON_INTERPRET=1 in the child process of test_in_fresh_process")

    return _where_it_runs


def run_under_interpreter(test_file: str, min_passed: int, **env: str) -> None:
    """Runs ``test_file`` in a child pytest with ``TRITON_INTERPRET=1`` (plus ``env``) and asserts that all its
    tests passed there, at least ``min_passed`` of them, except the two that run in the parent."""
    child_env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **env)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", test_file],
                          env=child_env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.search(r"^(\d+) passed, 2 skipped in", summary), proc.stdout[-2000:]
    assert int(summary.split()[0]) >= min_passed, summary

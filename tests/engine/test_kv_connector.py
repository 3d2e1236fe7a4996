"""The KV connector seams, the offload connector, the recording wrapper and the buggy connector (issue 8).

Scenarios (the same ones notebook 08 runs, with the numbers it states):

* LIFECYCLE: one 40-token prompt, block_size 16, budget 16 tokens, 10 output tokens.
* PREEMPT: two 12-token prompts, block_size 4, 10 blocks, 16 output tokens each: B is preempted once.
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minivllm import LLMEngine, SamplingParams
from minivllm.course.trace import TracedLLMEngine
from minivllm.course.buggy_connector import BuggyOffloadConnector
from minivllm.course.recording_connector import RecordingConnector, connector_rows
from minivllm.distributed.kv_transfer import KVBlockStore, OffloadConnector

GREEDY16 = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
GREEDY10 = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
LIFECYCLE_PROMPT = list(range(1, 41))
PREEMPT_PROMPTS = {"A": list(range(1, 13)), "B": list(range(100, 112))}


def run(prompts, params, connector=None, **kw):
    """Run ``{id: prompt}`` to completion on the tiny model; returns ``(engine, {id: output token ids})``."""
    traced = kw.pop("traced", True)
    kw.setdefault("num_gpu_blocks", 64)  # the default pool (thousands of blocks) only makes each step slower
    engine = (TracedLLMEngine if traced else LLMEngine)("tiny", kv_connector=connector, **kw)
    for rid, p in prompts.items():
        engine.add_request(rid, p, params)
    out = engine.run_to_completion(max_steps=2000)
    return engine, {rid: o.outputs[0].token_ids for rid, o in out.items()}


def calls(engine, name, req_id=None):
    """``(step, call record)`` for every recorded call ``name`` (optionally of one request)."""
    return [(s.step, d) for s in engine.trace for d in s.connector_calls
            if d["call"] == name and (req_id is None or d.get("req_id") == req_id)]


@pytest.fixture(scope="module")
def lifecycle_ref():
    return run({"A": LIFECYCLE_PROMPT}, GREEDY10, block_size=16)[1]


@pytest.fixture(scope="module")
def preempt_ref():
    return run(PREEMPT_PROMPTS, GREEDY16, block_size=4)[1]


# ---- the offload connector keeps outputs identical -----------------------------------------------------------
def test_lifecycle_saves_three_blocks_in_steps_0_1_10(lifecycle_ref):
    conn = RecordingConnector(OffloadConnector(16))
    engine, out = run({"A": LIFECYCLE_PROMPT}, GREEDY10, conn, block_size=16, max_num_batched_tokens=16)
    assert out == lifecycle_ref
    # 40 prompt + 10 output tokens; the last sampled token is never computed: 49 tokens -> 3 full blocks.
    assert conn.stats.for_request("A") == {"loads": 0, "loaded_blocks": 0, "saved_blocks": 3}
    saves = [(step, d["meta"]["save"]) for step, d in calls(engine, "build_connector_meta") if d["meta"]["save"]]
    assert saves == [(0, {"A": 1}), (1, {"A": 1}), (10, {"A": 1})]
    assert conn.store.num_cpu_blocks == 3


def test_second_engine_loads_from_shared_disk_store(tmp_path, lifecycle_ref):
    first = OffloadConnector(16, disk_path=str(tmp_path))
    _, out1 = run({"A": LIFECYCLE_PROMPT}, GREEDY10, first, block_size=16, max_num_batched_tokens=16)
    assert out1 == lifecycle_ref
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".pt")]) == 3
    # A new engine and a new connector that share nothing but the folder.
    second = RecordingConnector(OffloadConnector(16, disk_path=str(tmp_path)))
    engine, out2 = run({"B": LIFECYCLE_PROMPT}, GREEDY10, second, block_size=16)
    assert out2 == {"B": lifecycle_ref["A"]}
    # (40 - 1) // 16 = 2 blocks = 32 tokens loaded; the remaining 8 prompt tokens computed; nothing new saved.
    assert second.stats.for_request("B") == {"loads": 1, "loaded_blocks": 2, "saved_blocks": 0}
    assert second.store.num_disk_reads == 2
    (step, match), = calls(engine, "get_num_new_matched_tokens", "B")
    assert (step, match["result"]) == (0, (32, False))
    assert engine.trace[0].num_scheduled_tokens == {"B": 8}


def test_preempted_request_loads_blocks_that_were_reused(preempt_ref):
    conn = RecordingConnector(OffloadConnector(4))
    engine, out = run(PREEMPT_PROMPTS, GREEDY16, conn, block_size=4, num_gpu_blocks=10)
    assert out == preempt_ref
    assert engine.trace.preemptions() == [(9, "B")]
    # B's first 3 blocks were still in the local prefix cache, the next 2 had been handed to A: loaded.
    assert calls(engine, "get_num_new_matched_tokens", "B")[-1][1]["result"] == (8, False)
    assert calls(engine, "get_num_new_matched_tokens", "B")[-1][1]["num_computed_tokens"] == 12
    assert conn.stats.for_request("A") == {"loads": 0, "loaded_blocks": 0, "saved_blocks": 6}
    assert conn.stats.for_request("B") == {"loads": 1, "loaded_blocks": 2, "saved_blocks": 6}
    resumed = [s.step for s in engine.trace if "B" in s.resumed]
    assert resumed == [16] and engine.trace[16].num_scheduled_tokens == {"B": 1}


def test_preemption_without_prefix_caching_loads_everything_but_the_last_token(preempt_ref):
    conn = OffloadConnector(4)
    engine, out = run(PREEMPT_PROMPTS, GREEDY16, conn, block_size=4, num_gpu_blocks=10, enable_prefix_caching=False)
    assert out == preempt_ref
    assert engine.num_preemptions == 1
    # At resumption B had 12 + k tokens; every full block before the last token came from the store (prefix
    # caching is off, so all the tokens B had computed when it resumed were loaded).
    resumed = next(s for s in engine.trace if "B" in s.resumed)
    assert conn.stats.num_loads["B"] == 1
    assert conn.stats.num_loaded_blocks["B"] == (resumed.num_computed_before["B"] // 4) > 0


@pytest.mark.parametrize("delay", [0, 1, 3])
def test_async_load_waits_delay_plus_one_steps(delay, lifecycle_ref):
    store = KVBlockStore()
    run({"A": LIFECYCLE_PROMPT}, GREEDY10, OffloadConnector(16, store=store), block_size=16)
    conn = RecordingConnector(OffloadConnector(16, load_mode="async", async_load_delay_steps=delay, store=store))
    engine, out = run({"C": LIFECYCLE_PROMPT}, GREEDY10, conn, block_size=16)
    assert out == {"C": lifecycle_ref["A"]}
    waiting = [s.step for s in engine.trace if s.requests.get("C") and s.requests["C"].status == "WAITING_FOR_REMOTE_KVS"]
    assert waiting == list(range(delay + 1))
    assert all(engine.trace[k].total_scheduled == 0 for k in waiting)
    # update_state_after_alloc twice: with the 32 external tokens, then with 0 when the load is done.
    allocs = [(step, d["num_external_tokens"]) for step, d in calls(engine, "update_state_after_alloc", "C")]
    assert allocs == [(0, 32), (delay + 1, 0)]
    recv = [step for step, d in calls(engine, "get_finished") if d["finished_recving"] == ["C"]]
    assert recv == [delay]
    assert engine.trace[delay + 1].num_scheduled_tokens == {"C": 8}
    assert conn.stats.for_request("C") == {"loads": 1, "loaded_blocks": 2, "saved_blocks": 0}
    in_flight = [step for step, d in calls(engine, "build_connector_meta") if d["meta"]["in_flight"] == ["C"]]
    assert in_flight == waiting


def test_async_preemption_matches_reference(preempt_ref):
    conn = OffloadConnector(4, load_mode="async")
    engine, out = run(PREEMPT_PROMPTS, GREEDY16, conn, block_size=4, num_gpu_blocks=10)
    assert out == preempt_ref
    assert engine.num_preemptions == 1
    assert conn.stats.for_request("B") == {"loads": 1, "loaded_blocks": 2, "saved_blocks": 6}


def test_abort_during_async_load_frees_blocks():
    store = KVBlockStore()
    run({"A": LIFECYCLE_PROMPT}, GREEDY10, OffloadConnector(16, store=store), block_size=16)
    conn = OffloadConnector(16, load_mode="async", async_load_delay_steps=5, store=store)
    engine = LLMEngine("tiny", kv_connector=conn, block_size=16, num_gpu_blocks=8)
    engine.add_request("C", LIFECYCLE_PROMPT, GREEDY10)
    engine.step()
    assert engine.kv_cache_manager.num_free_blocks == 6  # the 2 blocks being loaded are held
    engine.abort_request("C")
    assert engine.kv_cache_manager.num_free_blocks == 8
    assert not engine.has_unfinished_requests()
    assert conn._inflight == {} and conn._loading == set()


def test_cpu_capacity_evicts_and_resaves(lifecycle_ref):
    conn = OffloadConnector(16, cpu_capacity_blocks=1)
    _, out = run({"A": LIFECYCLE_PROMPT}, GREEDY10, conn, block_size=16)
    assert out == lifecycle_ref and conn.store.num_cpu_blocks == 1
    _, out2 = run({"B": LIFECYCLE_PROMPT}, GREEDY10, conn, block_size=16)
    # only the newest block (2) survived; without block 0 nothing matches, and each save evicts the block saved
    # before it, so block 2 is gone again by the time B completes it: all 3 saved again
    assert out2 == {"B": lifecycle_ref["A"]}
    assert conn.stats.for_request("B") == {"loads": 0, "loaded_blocks": 0, "saved_blocks": 3}
    assert conn.store.num_cpu_blocks == 1


def test_async_loads_held_while_waiting_do_not_deadlock_the_pool():
    # Found by the random test below: C's async load holds 2 of 8 blocks while it waits behind B; B, preempted,
    # needs 7 blocks and nothing runs. The scheduler gives C's blocks back (C asks the connector again later).
    prefix = list(range(200, 208))
    prompts = {r: prefix + list(range(10 * i + 1, 10 * i + 10)) for i, r in enumerate("ABC")}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    _, ref = run(prompts, params, block_size=4, enable_prefix_caching=False)
    conn = RecordingConnector(OffloadConnector(4, load_mode="async"))
    engine, out = run(prompts, params, conn, block_size=4, num_gpu_blocks=8, enable_prefix_caching=False,
                      max_num_batched_tokens=8)
    assert out == ref
    assert engine.trace.preemptions() == [(25, "B")]
    c = [s.requests["C"] for s in engine.trace if "C" in s.requests]
    # C: loaded 8 tokens (2 blocks) while waiting, released them when the pool stalled, loaded them again later
    assert [(r.num_computed_tokens, len(r.block_ids)) for r in c[24:27]] == [(8, 2), (8, 2), (0, 0)]
    assert conn.stats.for_request("C")["loads"] == 2


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    num_blocks=st.integers(8, 14),
    shared=st.integers(0, 12),
    mode=st.sampled_from(["sync", "async"]),
    caching=st.booleans(),
    budget=st.sampled_from([8, 16, 64]),
)
def test_random_workloads_match_reference(num_blocks, shared, mode, caching, budget):
    prefix = list(range(200, 200 + shared))
    prompts = {r: prefix + list(range(10 * i + 1, 10 * i + 1 + 13 - shared // 2)) for i, r in enumerate("ABC")}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    _, ref = run(prompts, params, block_size=4, enable_prefix_caching=False, traced=False)
    conn = OffloadConnector(4, load_mode=mode)
    _, out = run(prompts, params, conn, block_size=4, num_gpu_blocks=num_blocks, enable_prefix_caching=caching,
                 max_num_batched_tokens=budget, traced=False)
    assert out == ref


# ---- the engine's call contract -------------------------------------------------------------------------------
def test_build_connector_meta_once_per_step_including_empty_steps():
    store = KVBlockStore()
    run({"A": LIFECYCLE_PROMPT}, GREEDY10, OffloadConnector(16, store=store), block_size=16)
    conn = RecordingConnector(OffloadConnector(16, load_mode="async", async_load_delay_steps=2, store=store))
    engine, _ = run({"C": LIFECYCLE_PROMPT}, GREEDY10, conn, block_size=16)
    per_step = [sum(d["call"] == "build_connector_meta" for d in s.connector_calls) for s in engine.trace]
    assert per_step == [1] * len(engine.trace)
    assert [s.step for s in engine.trace if s.total_scheduled == 0] == [0, 1, 2]
    for s in engine.trace:  # worker side: once each per step, in this order
        worker = [d["call"] for d in s.connector_calls if d["side"] == "worker" and d["call"] != "save_kv_layer"]
        expected = ["bind_connector_metadata", "start_load_kv"]
        expected += ["wait_for_save"] if s.total_scheduled else []
        assert worker == expected + ["get_finished", "clear_connector_metadata"]
        layers = [d["layer"] for d in s.connector_calls if d["call"] == "save_kv_layer"]
        assert layers == ([0, 1] if s.total_scheduled else [])


def test_stuck_waiting_request_is_asked_every_step_but_never_allocated():
    conn = RecordingConnector(OffloadConnector(4))
    engine, _ = run(PREEMPT_PROMPTS, GREEDY16, conn, block_size=4, num_gpu_blocks=10)
    asked = [step for step, _ in calls(engine, "get_num_new_matched_tokens", "B")]
    allocated = [step for step, _ in calls(engine, "update_state_after_alloc", "B")]
    assert asked == [0] + list(range(10, 17))  # admitted at 0; after its preemption at 9, asked 10..16
    assert allocated == [0, 16]
    for k in range(10, 16):
        assert "B" in engine.trace[k].waiting and "B" not in engine.trace[k].num_scheduled_tokens


def test_calls_are_recorded_in_the_step_they_happen():
    conn = RecordingConnector(OffloadConnector(16))
    engine, _ = run({"A": LIFECYCLE_PROMPT}, GREEDY10, conn, block_size=16, max_num_batched_tokens=16)
    first = [d["call"] for d in engine.trace[0].connector_calls if d["call"] != "save_kv_layer"]
    assert first == ["get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                     "bind_connector_metadata", "start_load_kv", "wait_for_save", "get_finished",
                     "clear_connector_metadata"]
    finished = [step for step, _ in calls(engine, "request_finished", "A")]
    assert finished == [len(engine.trace) - 1] and "A" in engine.trace[finished[0]].finished
    assert all(d["step"] == s.step for s in engine.trace for d in s.connector_calls)
    assert len(conn.calls) == sum(len(s.connector_calls) for s in engine.trace)
    rows = connector_rows(engine.trace)
    assert rows[0]["scheduler side"] == "match(A, 0)->(0, sync) · alloc(A, ext=0) · meta(new A=16)[save A:1]"
    assert rows[3]["scheduler side"] == "meta(cached A=1)[]"


def test_abort_between_steps_is_filed_under_the_next_step():
    conn = RecordingConnector(OffloadConnector(16))
    engine = TracedLLMEngine("tiny", kv_connector=conn, block_size=16, num_gpu_blocks=64)
    engine.add_request("A", LIFECYCLE_PROMPT, GREEDY10)
    engine.add_request("B", LIFECYCLE_PROMPT[:20], GREEDY10)
    engine.step()
    engine.abort_request("A")
    engine.step()
    assert [d["req_id"] for d in engine.trace[1].connector_calls if d["call"] == "request_finished"] == ["A"]


# ---- the buggy connector ----------------------------------------------------------------------------------------
def _buggy_scenario(connector):
    store = connector.store
    run({"A": LIFECYCLE_PROMPT}, GREEDY10, OffloadConnector(16, store=store), block_size=16)
    return run({"B": LIFECYCLE_PROMPT, "C": [7] * 20}, GREEDY10, RecordingConnector(connector), block_size=16)


def test_buggy_connector_emits_the_same_load_every_step(lifecycle_ref):
    buggy = BuggyOffloadConnector(16, store=KVBlockStore())
    engine, out = _buggy_scenario(buggy)
    loads = [d["meta"]["load"] for _, d in calls(engine, "build_connector_meta")]
    assert loads == [{"B": 2}] * len(engine.trace)  # every step, including the one in which B finished
    assert buggy.stats.num_loads["B"] == len(engine.trace)
    assert out["B"] == lifecycle_ref["A"]  # same blocks re-copied: wasteful, not (yet) wrong
    fixed = OffloadConnector(16, store=KVBlockStore())
    engine2, out2 = _buggy_scenario(fixed)
    loads2 = [d["meta"]["load"] for _, d in calls(engine2, "build_connector_meta")]
    assert loads2 == [{"B": 2}] + [{}] * (len(engine2.trace) - 1)
    assert fixed.stats.num_loads["B"] == 1 and out2 == out


def test_buggy_connector_emits_a_request_that_has_no_blocks():
    buggy = BuggyOffloadConnector(4, store=KVBlockStore())
    run({"B": PREEMPT_PROMPTS["B"]}, GREEDY16, OffloadConnector(4, store=buggy.store), block_size=4)
    # A occupies the pool; B matches in the store but cannot be admitted for several steps.
    conn = RecordingConnector(buggy)
    engine = TracedLLMEngine("tiny", kv_connector=conn, block_size=4, num_gpu_blocks=8)
    engine.add_request("A", list(range(1, 25)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.add_request("B", PREEMPT_PROMPTS["B"], GREEDY16)
    engine.run_to_completion(max_steps=200)
    stuck = [s.step for s in engine.trace if "B" in s.waiting]
    assert len(stuck) >= 2
    for k in stuck:
        d = next(d for d in engine.trace[k].connector_calls if d["call"] == "build_connector_meta")
        assert d["meta"]["load"] == {"B": 0}  # "load B" with no block to load into
    assert not calls(engine, "update_state_after_alloc", "B")[0][0] < stuck[-1]


def test_buggy_connector_corrupts_other_requests_after_preemption():
    three = {r: list(range(20 * i + 1, 20 * i + 13)) for i, r in enumerate("ABC")}
    _, ref = run(three, GREEDY16, block_size=4)
    buggy = BuggyOffloadConnector(4)
    engine, out = run(three, GREEDY16, buggy, block_size=4, num_gpu_blocks=10)
    assert engine.trace.preemptions() == [(1, "C"), (9, "B"), (20, "C")]
    # C's load, recorded while C waited, targets the block table C had before its preemption: A's and B's now
    assert out["C"] == ref["C"] and out["A"] != ref["A"] and out["B"] != ref["B"]
    _, fixed_out = run(three, GREEDY16, OffloadConnector(4), block_size=4, num_gpu_blocks=10)
    assert fixed_out == ref


# ---- bad input -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [
    {"block_size": 0}, {"load_mode": "later"}, {"async_load_delay_steps": -1}, {"cpu_capacity_blocks": 0},
    {"store": KVBlockStore(), "disk_path": "/tmp/x"},
])
def test_bad_arguments_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        OffloadConnector(**kwargs)


def test_block_size_mismatch_raises_value_error():
    engine = LLMEngine("tiny", kv_connector=OffloadConnector(8), block_size=16, num_gpu_blocks=64)
    engine.add_request("A", [1, 2, 3], GREEDY10)
    with pytest.raises(ValueError, match="block_size"):
        engine.step()


def test_disk_block_of_another_shape_raises_value_error(tmp_path):
    store = KVBlockStore(str(tmp_path))
    h = bytes(32)
    store.put(h, torch.zeros(2, 2, 4, 2, 16))
    other = KVBlockStore(str(tmp_path))
    assert other.contains(h) and other.get_cpu(h) is None
    with pytest.raises(ValueError, match="one disk_path per model"):
        other.read_disk(h, (2, 2, 4, 2, 8), torch.float32)


def test_recording_connector_rejects_non_connectors():
    with pytest.raises(ValueError):
        RecordingConnector(object())


# ---- the real model ---------------------------------------------------------------------------------------------
def test_real_model_text_unchanged_by_offloading(real_llm):
    from minivllm.model.tokenizer import apply_chat_template

    tok = real_llm.get_tokenizer()
    system = ("You are a concise assistant for a course on inference engines. The course builds a small engine in the "
              "style of vLLM: a scheduler with a token budget, a paged KV cache in blocks of sixteen tokens, chunked "
              "prefill, preemption and prefix caching. Answer every question in one short sentence.")
    prompts = {
        str(i): apply_chat_template(tok, [{"role": "system", "content": system}, {"role": "user", "content": q}])
        for i, q in enumerate(["What is the capital of France?", "What is a KV cache?"])
    }
    params = SamplingParams(temperature=0, max_tokens=16)
    ref = {rid: o.outputs[0].token_ids for rid, o in zip(
        prompts, real_llm.generate([{"prompt_token_ids": p} for p in prompts.values()], params, use_tqdm=False))}
    conn = OffloadConnector(16)
    # the same weights, a new engine with prefix caching off: the second request's shared system prompt can
    # only come from the connector's store; one at a time, so the first has saved its blocks before the second
    engine = LLMEngine(real_llm.llm_engine.model, tokenizer=tok, kv_connector=conn, num_gpu_blocks=64,
                       enable_prefix_caching=False, max_num_seqs=1)
    for rid, p in prompts.items():
        engine.add_request(rid, p, params)
    out = {rid: o.outputs[0].token_ids for rid, o in engine.run_to_completion().items()}
    assert out == ref
    a, b = prompts.values()
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert common >= 64
    # every full block of the shared beginning, and nothing else, came from the store
    full_blocks = (len(b) + len(out["1"]) - 1) // 16  # the last sampled token has no KV
    assert conn.stats.for_request("1") == {"loads": 1, "loaded_blocks": common // 16,
                                            "saved_blocks": full_blocks - common // 16}

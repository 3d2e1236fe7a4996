"""Checker for notebook 08's exercise: a connector without ``BuggyOffloadConnector``'s bug.

The learner's connector class is run through the three scenarios in which the buggy one fails (notebook 08,
section 7): the same load emitted in every step, a load for a request that holds no blocks, and loads into blocks
that belong to other requests after a preemption. Expected values come from runs without a connector and from the
connector contract (vLLM 0.32 ``KVConnectorBase_V1``: ``build_connector_meta`` resets the per-step state; a load is
decided in ``update_state_after_alloc``, once the blocks exist).
"""

from __future__ import annotations

from typing import Callable, Dict, List

from minivllm.course.exercises._harness import ExerciseFailed, _NotWrittenYet, checker, fail

PROMPT = list(range(1, 41))
B_PROMPT = list(range(100, 112))
STUCK_PROMPTS = {"A": list(range(1, 25)), "B": B_PROMPT}
THREE = {r: list(range(20 * i + 1, 20 * i + 13)) for i, r in enumerate("ABC")}


def _run(prompts: Dict[str, List[int]], max_tokens: int, connector=None, **kw):
    from minivllm import SamplingParams
    from minivllm.course.trace import TracedLLMEngine

    kw.setdefault("num_gpu_blocks", 64)
    engine = TracedLLMEngine("tiny", kv_connector=connector, **kw)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    out = engine.run_to_completion(max_steps=1000)
    return engine, {rid: o.outputs[0].token_ids for rid, o in out.items()}


def _loads_per_step(engine) -> List[dict]:
    return [d["meta"]["load"] for s in engine.trace for d in s.connector_calls if d["call"] == "build_connector_meta"]


def _build(cls: Callable, ex: str, *args, **kwargs):
    __tracebackhide__ = True
    try:
        return cls(*args, **kwargs)
    except NotImplementedError:
        raise _NotWrittenYet() from None
    except Exception as e:  # noqa: BLE001 - reported with the arguments
        raise ExerciseFailed(f"{ex}({', '.join(map(repr, args))}, ...) raised {type(e).__name__}: {e}") from None


def _scenario(ex: str, desc: str, run: Callable):
    __tracebackhide__ = True
    try:
        return run()
    except NotImplementedError:
        raise _NotWrittenYet() from None
    except ExerciseFailed:
        raise
    except Exception as e:  # noqa: BLE001 - any error of the learner's connector is reported with the scenario
        raise ExerciseFailed(f"{ex} raised {type(e).__name__} in the scenario {desc}:\n    {e}") from None


@checker("FixedConnector")
def check_fixed_connector(cls: Callable) -> int:
    """Check a connector class built like ``OffloadConnector(block_size, store=None)`` on the buggy connector's
    three failing scenarios (notebook 08, section 7):

    1. ``B`` shares two blocks with a prompt saved by an earlier engine: one load of 2 blocks in its first step,
       then nothing (``{}``) in every later step; the worker loads ``B`` once; outputs as without a connector.
    2. ``B`` waits four steps for blocks (8 blocks of 4): no load while it has no blocks, its load of 2 blocks in
       the step that admits it (step 4), nothing after; outputs as without a connector.
    3. ``C`` is preempted twice (10 blocks of 4): every output equals the run without a connector, and ``C`` is
       loaded twice.

    Raises:
        ExerciseFailed: naming the scenario, the step, what was expected and what the connector did.
    """
    from minivllm.course.recording_connector import RecordingConnector
    from minivllm.distributed.kv_transfer import KVBlockStore, OffloadConnector

    ex = "FixedConnector"
    hint_meta = ("build_connector_meta must reset the per-step state (vLLM's contract: 'calling this function will "
                 "reset the state of the connector'): clear the recorded loads after emitting them.")
    hint_ask = ("get_num_new_matched_tokens is only a question, asked again every step a request waits: decide the "
                "load in update_state_after_alloc, which is called once the blocks exist, and only if "
                "num_external_tokens > 0.")

    # 1. the same load in every step
    desc1 = "1 (B shares two blocks with a saved prompt; block_size 16)"

    def one():
        conn = _build(cls, ex, 16, store=KVBlockStore())
        _run({"A": PROMPT}, 10, OffloadConnector(16, store=conn.store), block_size=16)
        eng, out = _run({"B": PROMPT, "C": [7] * 20}, 10, RecordingConnector(conn), block_size=16)
        return conn, eng, out

    conn, eng, out = _scenario(ex, desc1, one)
    _, ref = _run({"B": PROMPT, "C": [7] * 20}, 10, block_size=16)
    loads = _loads_per_step(eng)
    expected = [{"B": 2}] + [{}] * (len(eng.trace) - 1)
    if loads != expected:
        k = next(i for i, (a, b) in enumerate(zip(loads, expected)) if a != b)
        fail(ex, desc1, f"step {k}: the metadata loads {loads[k]}, expected {expected[k]} (loads per step: "
             f"{loads})", hint_meta if k > 0 else hint_ask)
    if conn.stats.num_loads.get("B", 0) != 1:
        fail(ex, desc1, f"the worker loaded B {conn.stats.num_loads.get('B', 0)} times, expected once", hint_meta)
    if out != ref:
        fail(ex, desc1, f"outputs differ from the run without a connector: {out} != {ref}")

    # 2. a load for a request without blocks
    desc2 = "2 (B waits for blocks: 8 blocks of 4)"

    def two():
        conn = _build(cls, ex, 4, store=KVBlockStore())
        _run({"B": B_PROMPT}, 16, OffloadConnector(4, store=conn.store), block_size=4)
        return _run(STUCK_PROMPTS, 4, RecordingConnector(conn), block_size=4, num_gpu_blocks=8)

    eng, out = _scenario(ex, desc2, two)
    _, ref = _run(STUCK_PROMPTS, 4, block_size=4)
    loads = _loads_per_step(eng)[:6]
    expected = [{}, {}, {}, {}, {"B": 2}, {}]
    if loads != expected:
        k = next(i for i, (a, b) in enumerate(zip(loads, expected)) if a != b)
        fail(ex, desc2, f"step {k}: the metadata loads {loads[k]}, expected {expected[k]} (B is admitted in step "
             f"4; loads of steps 0-5: {loads})", hint_ask if k < 4 else hint_meta)
    if out != ref:
        fail(ex, desc2, f"outputs differ from the run without a connector: {out} != {ref}")

    # 3. loads into other requests' blocks after a preemption
    desc3 = "3 (C is preempted twice: 10 blocks of 4)"

    def three():
        conn = _build(cls, ex, 4)
        return (conn, *_run(THREE, 16, conn, block_size=4, num_gpu_blocks=10))

    conn, eng, out = _scenario(ex, desc3, three)
    _, ref = _run(THREE, 16, block_size=4)
    for rid in sorted(ref):
        if out.get(rid) != ref[rid]:
            diff = next((i for i, (x, y) in enumerate(zip(out.get(rid, []), ref[rid])) if x != y), None)
            fail(ex, desc3, f"request {rid!r}'s output differs from the run without a connector from output token "
                 f"{diff} on: a load wrote into blocks that belong to another request",
                 hint_ask + " " + hint_meta)
    n = conn.stats.for_request("C")["loads"]
    if n != 2:
        fail(ex, desc3, f"C was loaded {n} times, expected 2 (once after each preemption)", hint_ask)
    return 3


__all__ = ["check_fixed_connector"]

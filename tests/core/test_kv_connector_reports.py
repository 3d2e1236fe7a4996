"""KV-transfer reports (``get_finished``) for requests in every state (vLLM 0.32:
``Scheduler._update_from_kv_xfer_finished`` in ``vllm/v1/core/sched/scheduler.py``).

vLLM records a ``finished_recving`` id only for a request in ``WAITING_FOR_REMOTE_KVS``; for a finished request it
frees the blocks it kept for the transfer; anything else is an assertion failure. ``finished_sending`` frees the
blocks of a finished request and asserts on a live one. minivllm frees a request's blocks when it finishes (the
connector must be done with them in ``request_finished``), so a report for a finished request has nothing left to
free and is dropped; a report vLLM would assert on raises a ``RuntimeError`` naming the connector, the request and
its state, before any scheduler state changes.
"""

import pytest

from minivllm import LLMEngine, SamplingParams
from minivllm.distributed.kv_transfer import KVConnectorBase, KVConnectorMetadata, OffloadConnector
from minivllm.request import RequestStatus

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class ReportingConnector(KVConnectorBase):
    """Supplies nothing; reports whatever the test puts in ``recving`` / ``sending`` at the next ``get_finished``."""

    def __init__(self):
        super().__init__()
        self.recving, self.sending = set(), set()

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def start_load_kv(self, kv_caches):
        pass

    def get_finished(self, finished_req_ids):
        out = (set(self.sending) or None, set(self.recving) or None)
        self.recving, self.sending = set(), set()
        return out


def _engine(connector, **kw):
    return LLMEngine("tiny", kv_connector=connector, block_size=4, num_gpu_blocks=32, max_num_batched_tokens=16, **kw)


def _state(engine):
    s, kv = engine.scheduler, engine.kv_cache_manager
    return (s.queue_snapshot(), sorted(s.requests), set(s.finished_recving_kv_req_ids), set(s.finished_req_ids),
            {rid: (r.status, list(r.output_token_ids), r.num_computed_tokens) for rid, r in s.requests.items()},
            {rid: kv.get_block_ids(rid) for rid in s.requests}, kv.num_free_blocks, s.stats.num_scheduled_tokens)


@pytest.mark.parametrize("kind", ["recving", "sending"])
@pytest.mark.parametrize("where", ["RUNNING", "WAITING"])
def test_report_for_a_live_request_not_waiting_for_kv_raises_and_changes_nothing(kind, where):
    conn = ReportingConnector()
    eng = _engine(conn, max_num_seqs=1)
    eng.add_request("a", list(range(1, 9)), GREEDY)
    eng.add_request("b", list(range(20, 28)), GREEDY)  # waits: max_num_seqs=1
    eng.step()
    rid = "a" if where == "RUNNING" else "b"
    assert eng.scheduler.requests[rid].status == RequestStatus[where]
    so = eng.scheduler.schedule()
    getattr(conn, kind).add(rid)
    assert eng.model_runner.execute_model(so) is None  # the forward pass; sample_tokens samples (vLLM 0.32)
    mro = eng.model_runner.sample_tokens()
    assert mro.sampled_token_ids == [[mro.sampled_token_ids[0][0]]]  # "a" decoded a token in this step
    before = _state(eng)
    with pytest.raises(RuntimeError) as e:
        eng.scheduler.update_from_output(so, mro)
    msg = str(e.value)
    assert "ReportingConnector" in msg and repr(rid) in msg and where in msg and f"finished_{kind}" in msg
    assert _state(eng) == before  # not even "a"'s sampled token was appended
    assert not eng.scheduler.finished_recving_kv_req_ids


@pytest.mark.parametrize("kind", ["recving", "sending"])
def test_report_for_a_finished_request_leaves_no_stale_entry(kind):
    conn = ReportingConnector()
    eng = _engine(conn)
    eng.add_request("a", list(range(1, 9)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    eng.add_request("b", list(range(20, 28)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while "a" in eng.scheduler.requests:
        eng.step()
    getattr(conn, kind).add("a")  # a late report: "a" finished, its blocks are back in the pool
    free_before = eng.kv_cache_manager.num_free_blocks
    eng.step()
    assert "a" not in eng.scheduler.finished_recving_kv_req_ids
    assert eng.kv_cache_manager.num_free_blocks == free_before  # nothing freed twice ("b" holds its blocks)
    final = eng.run_to_completion()
    assert len(final["b"].outputs[0].token_ids) == 8
    assert eng.kv_cache_manager.num_free_blocks == 32


def test_stale_report_does_not_release_a_later_async_load_early():
    """The issue's failure: a report that is kept for a request that is not waiting would make that request's
    next asynchronous load (here: a new request reusing the id) count as finished before the connector says so."""
    delay = 3
    conn = OffloadConnector(4, load_mode="async", async_load_delay_steps=delay)
    eng = LLMEngine("tiny", kv_connector=conn, block_size=4, num_gpu_blocks=64, enable_prefix_caching=False)
    prompt = list(range(1, 14))
    eng.add_request("warm", prompt, GREEDY)  # fills the store with the prompt's 3 full blocks
    ref = eng.run_to_completion()["warm"].outputs[0].token_ids
    eng.add_request("r", list(range(40, 50)), GREEDY)
    eng.run_to_completion()
    so = eng.scheduler.schedule()  # an empty step, with a late report for the finished "r"
    mro = eng.model_runner.execute_model(so)  # a step with no token: execute_model returns its output
    assert mro is not None
    mro.finished_recving = {"r"}
    assert eng.scheduler.update_from_output(so, mro) == []
    assert not eng.scheduler.finished_recving_kv_req_ids
    eng.add_request("r", prompt, GREEDY)  # the id again, now with an asynchronous load
    statuses = []
    while not statuses or statuses[-1] != RequestStatus.RUNNING:
        eng.step()
        statuses.append(eng.scheduler.requests["r"].status)
    # Parked in the first step; the load is reported `delay` steps later; admitted in the step after the report.
    assert statuses.count(RequestStatus.WAITING_FOR_REMOTE_KVS) == delay + 1, statuses
    assert eng.run_to_completion()["r"].outputs[0].token_ids == ref


def test_recving_report_for_a_waiting_for_kv_request_is_recorded():
    conn = OffloadConnector(4, load_mode="async", async_load_delay_steps=2)
    eng = LLMEngine("tiny", kv_connector=conn, block_size=4, num_gpu_blocks=64, enable_prefix_caching=False)
    prompt = list(range(1, 14))
    eng.add_request("warm", prompt, GREEDY)
    ref = eng.run_to_completion()["warm"].outputs[0].token_ids
    eng.add_request("s", prompt, GREEDY)
    eng.step()
    assert eng.scheduler.requests["s"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert eng.run_to_completion()["s"].outputs[0].token_ids == ref
    assert conn.stats.for_request("s")["loaded_blocks"] == 3

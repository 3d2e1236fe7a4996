"""Record real vLLM's schedule of every scenario (run with the vLLM environment's Python, never the course's).

    .venv-vllm/bin/python minivllm/bench/vllm_check/vllm_recorder.py --scenarios S.json --model DIR --out R.json

Two ways, as ``minivllm/bench/vllm_check/__init__.py`` explains:

* ``v1-sync`` (live): vLLM's own engine (``vllm.v1.engine.llm_engine.LLMEngine``, in-process with
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``enforce_eager=True``, its V1 model runner on the CPU) runs the scenario
  on the float32 SmolLM2 folder and samples greedily. The engine is started once (start-up takes 75-90 s); for each
  scenario a fresh ``Scheduler`` (vLLM's class, built like ``EngineCore`` builds it, from the engine's
  ``VllmConfig`` with the scenario's token budget, ``max_num_seqs``, ``long_prefill_token_threshold``,
  prefix caching and a pool of ``num_usable_blocks + 1`` blocks) replaces the engine core's scheduler, so
  every scenario starts from an empty cache. Everything is recorded, greedy tokens included.
* ``v1-sync-scripted``, ``v1-async``, ``v2-sync``, ``v2-async``: vLLM's ``Scheduler`` (``AsyncScheduler`` for
  async) built from a configuration with a local ``config.json`` (no model weights), switched to the V2 runner's
  behaviour with its ``use_v2_model_runner`` attribute (vLLM's CPU build resolves that to False and async
  scheduling to False, so neither can be had through the engine here), and driven by hand-made
  ``ModelRunnerOutput``s carrying the scenario's scripted tokens. Everything the scheduler decides is recorded;
  no model runs.

Also records vLLM's own source lines that the course quotes, read with ``inspect`` from the installed vLLM.
Nothing from minivllm is imported here.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # driver.py and vllm_recording_connector.py, by module name

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # V2 cannot start on x86 without triton-cpu
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import driver  # noqa: E402

CONNECTOR = "RecordingKVConnector"
CONNECTOR_MODULE = "vllm_recording_connector"
SCRIPTED_MODES = {"v1-sync-scripted": (False, False), "v1-async": (False, True), "v2-sync": (True, False),
                  "v2-async": (True, True)}


def _kv_transfer_config():
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector=CONNECTOR, kv_connector_module_path=CONNECTOR_MODULE, kv_role="kv_both")


def _sampling_params(spec):
    """vLLM's SamplingParams of a scenario request (EOS: the live engine takes it from the model folder's
    tokenizer, the scripted adapter sets the scenario's with ``update_from_generation_config``)."""
    from vllm import SamplingParams

    s = spec["sampling"]
    sp = SamplingParams(temperature=s.get("temperature", 0.0), max_tokens=s["max_tokens"],
                        ignore_eos=s.get("ignore_eos", False), stop_token_ids=list(s.get("stop_token_ids", [])),
                        detokenize=False)
    return sp


def _snapshot(sched, so):
    """One step record from vLLM's scheduler right after ``schedule()`` returned ``so``."""
    cached = so.scheduled_cached_reqs
    resumed_set = set(getattr(cached, "resumed_req_ids", ()) or ())
    at_admission = {r.req_id: int(r.num_computed_tokens) for r in so.scheduled_new_reqs}
    for i, rid in enumerate(cached.req_ids):
        if rid in resumed_set:
            at_admission[rid] = int(cached.num_computed_tokens[i])
    waiting = [r.request_id for r in sched.kv_holding_waiting] + [r.request_id for r in sched.waiting]
    return {
        "num_scheduled_tokens": {k: int(v) for k, v in so.num_scheduled_tokens.items()},
        "total_num_scheduled_tokens": int(so.total_num_scheduled_tokens),
        "new": [r.req_id for r in so.scheduled_new_reqs],
        "cached": [r for r in cached.req_ids if r not in resumed_set],
        "resumed": [r for r in cached.req_ids if r in resumed_set],
        "num_computed_at_admission": at_admission,
        "preempted": [],  # filled by the wrapper from the waiting queue's order
        "finished_req_ids": sorted(so.finished_req_ids),
        "waiting": waiting,
        "running": [r.request_id for r in sched.running],
        "num_free_blocks": int(sched.kv_cache_manager.block_pool.get_num_free_blocks()),
        "new_block_ids": {r.req_id: [list(g) for g in r.block_ids] for r in so.scheduled_new_reqs},
    }


def _preempted_in_order(so, waiting):
    ids = set(so.preempted_req_ids or ())
    # Each victim is pushed to the *front* of the waiting queue, so the queue lists them last-preempted first.
    return list(reversed([rid for rid in waiting if rid in ids]))


def _instrument(sched, log):
    """Wrap ``schedule`` / ``update_from_output`` of this scheduler instance to fill ``log``."""
    orig_schedule, orig_update = sched.schedule, sched.update_from_output
    so_step = {}

    def schedule(*args, **kwargs):
        log.mark_schedule_start()
        so = orig_schedule(*args, **kwargs)
        rec = _snapshot(sched, so)
        rec["preempted"] = _preempted_in_order(so, rec["waiting"])
        so_step[id(so)] = log.add(rec)
        return so

    def update_from_output(so, mro):
        outs = orig_update(so, mro)
        i = so_step.pop(id(so), None)
        if i is not None:
            sampled = {}
            for rid, idx in mro.req_id_to_index.items():
                if rid in so.num_scheduled_tokens:
                    sampled[rid] = [int(t) for t in mro.sampled_token_ids[idx]]
            log.steps[i]["sampled"] = sampled
            fin = {}
            for eco in outs.values():
                for o in eco.outputs:
                    if o.finish_reason is not None:
                        fin[o.request_id] = str(o.finish_reason)
            log.steps[i]["finished"] = fin
        return outs

    sched.schedule, sched.update_from_output = schedule, update_from_output

    def restore():
        sched.schedule, sched.update_from_output = orig_schedule, orig_update

    return restore


def _external_ids(obj, ids):
    """vLLM's engine appends a random suffix to each request id (``A`` -> ``A-1f2e3d4c``); map them back."""
    def fix(x):
        if isinstance(x, str):
            head, _, tail = x.rpartition("-")
            if head in ids and len(tail) == 8 and all(c in "0123456789abcdef" for c in tail):
                return head
            return x
        if isinstance(x, dict):
            return {fix(k): fix(v) for k, v in x.items()}
        if isinstance(x, list):
            return [fix(v) for v in x]
        return x
    return fix(obj)


# ---- live: the engine -------------------------------------------------------------------------------------------
def _new_scheduler_for(core, base_config, engine_kv_cache_config, engine_sched_kwargs, eng):
    """A fresh vLLM scheduler for one scenario, built as ``EngineCore.__init__`` builds it."""
    import dataclasses

    vc = copy.copy(base_config)
    sc = copy.copy(base_config.scheduler_config)
    sc.max_num_batched_tokens = eng["max_num_batched_tokens"]
    sc.max_num_scheduled_tokens = None
    sc.max_num_seqs = eng["max_num_seqs"]
    sc.long_prefill_token_threshold = eng["long_prefill_token_threshold"]
    cc = copy.copy(base_config.cache_config)
    cc.enable_prefix_caching = eng["enable_prefix_caching"]
    cc.num_gpu_blocks = eng["num_usable_blocks"] + 1
    object.__setattr__(vc, "scheduler_config", sc)
    object.__setattr__(vc, "cache_config", cc)
    kvc = dataclasses.replace(engine_kv_cache_config, num_blocks=eng["num_usable_blocks"] + 1)
    cls = type(core.scheduler)
    return cls(vllm_config=vc, kv_cache_config=kvc, **engine_sched_kwargs)


def record_live(scenarios, model_dir, verbose=True):
    """Run every scenario on vLLM's engine; returns ``{name: recording}`` and the engine's settings."""
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    import vllm_recording_connector as rc

    engs = [s["engine"] for s in scenarios]
    t0 = time.time()
    args = EngineArgs(
        model=model_dir, tokenizer=model_dir, dtype="float32", enforce_eager=True, seed=0,
        block_size=32, num_gpu_blocks_override=max(e["num_usable_blocks"] for e in engs) + 1,
        max_model_len=max(e["max_model_len"] for e in engs),
        max_num_batched_tokens=max(e["max_num_batched_tokens"] for e in engs),
        max_num_seqs=max(e["max_num_seqs"] for e in engs),
        enable_prefix_caching=True, kv_transfer_config=_kv_transfer_config(),
    )
    engine = LLMEngine.from_engine_args(args)
    startup_s = time.time() - t0
    core = engine.engine_core.engine_core
    base = core.scheduler
    base_config = base.vllm_config
    sched_kwargs = dict(structured_output_manager=base.structured_output_manager, block_size=base.block_size,
                        log_stats=base.log_stats)
    if "hash_block_size" in type(base).__init__.__code__.co_varnames:
        sched_kwargs["hash_block_size"] = getattr(base.kv_cache_manager, "hash_block_size", None) or base.block_size
    kv_cache_config = base.kv_cache_config
    settings = {
        "model": os.path.basename(os.path.normpath(model_dir)), "dtype": "float32", "enforce_eager": True,
        "engine_max_model_len": base_config.model_config.max_model_len,
        "async_scheduling": bool(base_config.scheduler_config.async_scheduling),
        "use_v2_model_runner": bool(getattr(base_config, "use_v2_model_runner", False)),
        "scheduler_class": f"{type(base).__module__}.{type(base).__name__}",
        "startup_seconds": round(startup_s, 1),
    }
    out = {}
    for sc in scenarios:
        t1 = time.time()
        # Flush the previous scenario's finished ids to the model runner with the old (unrecorded) scheduler.
        while core.scheduler.has_requests():
            core.step_fn()
        sched = _new_scheduler_for(core, base_config, kv_cache_config, sched_kwargs, sc["engine"])
        core.scheduler = sched
        rc.EVENTS.clear()
        log = driver.StepLog(rc.EVENTS)
        restore = _instrument(sched, log)
        final = {}

        def add_request(spec):
            engine.add_request(spec["id"], {"prompt_token_ids": list(spec["prompt_token_ids"])},
                               _sampling_params(spec))

        def step():
            for o in engine.step():
                if o.finished:
                    final[o.request_id] = {"token_ids": list(o.outputs[0].token_ids),
                                           "finish_reason": o.outputs[0].finish_reason,
                                           "num_cached_tokens": o.num_cached_tokens}

        driver.run_live(sc, add_request, step, engine.has_unfinished_requests)
        steps = log.finish()
        restore()  # the flush of finished ids before the next scenario is not part of this one
        ids = {r["id"] for r in sc["requests"]}
        out[sc["name"]] = {"steps": _external_ids(steps, ids), "outputs": _external_ids(final, ids),
                           "seconds": round(time.time() - t1, 1)}
        if verbose:
            print(f"  v1-sync  {sc['name']}: {len(steps)} steps, {time.time() - t1:.1f}s", flush=True)
    while core.scheduler.has_requests():
        core.step_fn()
    return out, settings


# ---- scripted: vLLM's Scheduler without a model ------------------------------------------------------------------
def write_tiny_config(folder):
    """A ``config.json`` (no weights) for building a ``ModelConfig`` offline: a 2-layer Llama, EOS 2."""
    os.makedirs(folder, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 128,
           "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
           "head_dim": 64, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return folder


def build_scheduler(eng, config_dir, v2, async_scheduling):
    """vLLM's ``Scheduler`` / ``AsyncScheduler`` for one scenario's engine settings (no model, no workers)."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    num_blocks = eng["num_usable_blocks"] + 1
    model_config = ModelConfig(model=config_dir, tokenizer=config_dir, skip_tokenizer_init=True, dtype="float32",
                               max_model_len=eng["max_model_len"], seed=0)
    scheduler_config = SchedulerConfig(
        max_num_seqs=eng["max_num_seqs"], max_num_batched_tokens=eng["max_num_batched_tokens"],
        max_model_len=eng["max_model_len"], long_prefill_token_threshold=eng["long_prefill_token_threshold"],
        enable_chunked_prefill=True, is_encoder_decoder=False, async_scheduling=async_scheduling,
    )
    cache_config = CacheConfig(block_size=eng["block_size"], enable_prefix_caching=eng["enable_prefix_caching"])
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config,
                             cache_config=cache_config, kv_transfer_config=_kv_transfer_config())
    # The CPU platform turns async scheduling off whatever is asked; the scheduler class decides the behaviour.
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], FullAttentionSpec(
            block_size=eng["block_size"], num_kv_heads=1, head_size=64, dtype=torch.float32))],
    )
    cls = AsyncScheduler if async_scheduling else Scheduler
    sched = cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                structured_output_manager=StructuredOutputManager(vllm_config), block_size=eng["block_size"],
                log_stats=True)
    sched.use_v2_model_runner = v2
    return sched


class _ScriptedAdapter(driver.ScriptedSchedulerAdapter):
    def __init__(self, sched, scenario, log):
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.outputs import ModelRunnerOutput

        self.model_runner_output_cls = ModelRunnerOutput

        init_none_hash(sha256)
        self.sched, self.log, self.eos = sched, log, scenario.get("eos_token_id", 2)
        self.hasher = get_request_block_hasher(scenario["engine"]["block_size"], sha256)
        self.t = 0.0
        _instrument(sched, log)

    def add_request(self, spec):
        from vllm.v1.request import Request

        sp = _sampling_params(spec)
        sp.update_from_generation_config({}, self.eos)
        self.t += 1.0
        self.sched.add_request(Request(request_id=spec["id"], prompt_token_ids=list(spec["prompt_token_ids"]),
                                       sampling_params=sp, pooling_params=None, arrival_time=self.t,
                                       block_hasher=self.hasher))

    def has_unfinished(self):
        return self.sched.get_num_unfinished_requests() > 0


def record_scripted(scenarios, modes, config_dir, verbose=True):
    import vllm_recording_connector as rc

    out = {}
    for mode in modes:
        v2, async_ = SCRIPTED_MODES[mode]
        out[mode] = {}
        for sc in scenarios:
            sched = build_scheduler(sc["engine"], config_dir, v2, async_)
            rc.EVENTS.clear()
            log = driver.StepLog(rc.EVENTS)
            adapter = _ScriptedAdapter(sched, sc, log)
            driver.run_scripted(sc, adapter, 2 if async_ else 1, log)
            steps = log.finish()
            finished = {}
            for st in steps:
                finished.update(st.get("finished") or {})
            outputs = {}
            for spec in sc["requests"]:
                outputs[spec["id"]] = {"finish_reason": finished.get(spec["id"])}
            out[mode][sc["name"]] = {"steps": steps, "outputs": outputs}
            if verbose:
                print(f"  {mode:<17}{sc['name']}: {len(steps)} steps", flush=True)
    return out


# ---- vLLM's own source lines --------------------------------------------------------------------------------------
QUOTES = {  # key: (module, function, text of the quoted line, lines of context kept before it)
    "admission_gate": ("vllm.v1.core.sched.scheduler", "Scheduler.schedule", "if not preempted_reqs", 0),
    "v2_resumed_as_new": ("vllm.v1.core.sched.scheduler", "Scheduler.schedule",
                          "scheduled_new_reqs.extend(scheduled_resumed_reqs)", 1),
    "async_placeholder_check": ("vllm.v1.core.sched.scheduler", "Scheduler.schedule",
                                "request.num_output_placeholders > 0", 1),
    "preempt_to_front": ("vllm.v1.core.sched.scheduler", "Scheduler._preempt_request", "prepend_request", 0),
    "async_placeholders_added": ("vllm.v1.core.sched.async_scheduler", "AsyncScheduler._update_after_schedule",
                                 "num_output_placeholders +=", 0),
    # Model Runner V2's seeded sampling: Gumbel noise hashed from (seed, position); a Triton kernel, so it is
    # read from the file (function None), not imported or run.
    "v2_gumbel_seed_position_hash": ("vllm.v1.worker.gpu.sample.gumbel", None,
                                     "def murmur3_hash32(seed, pos, offset", 1),
    "v1_start_load_kv_after_forward": ("vllm.v1.worker.kv_connector_model_runner_mixin",
                                       "KVConnectorModelRunnerMixin._get_kv_connector_output",
                                       "start_after_forward = not scheduler_output.has_sync_kv_loads", 0),
}


def read_source_quotes():
    """vLLM's own lines the course quotes: ``{key: {file, line, function, lines: [..]}}`` (a few lines of
    context from the line that holds the searched text, as installed)."""
    import importlib
    import importlib.util
    import inspect

    import vllm

    root = os.path.dirname(os.path.dirname(os.path.abspath(vllm.__file__)))
    quotes = {}
    for key, (module, qualname, needle, before) in QUOTES.items():
        if qualname is None:
            source_file = importlib.util.find_spec(module).origin
            with open(source_file) as f:
                lines, start = f.readlines(), 1
        else:
            obj = importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part)
            obj = inspect.unwrap(obj.__func__ if isinstance(obj, staticmethod) else obj)
            lines, start = inspect.getsourcelines(obj)
            source_file = inspect.getsourcefile(obj)
        hit = next((i for i, ln in enumerate(lines) if needle in ln), None)
        if hit is None:
            quotes[key] = {"error": f"{needle!r} not found in {qualname}"}
            continue
        end = hit + 1
        # Keep the statement: up to the line that ends with ':' or closes the parenthesis, at most 12 lines.
        depth = lines[hit].count("(") - lines[hit].count(")")
        while (depth > 0 or not lines[end - 1].rstrip().endswith((":", ")"))) and end < min(len(lines), hit + 12):
            depth += lines[end].count("(") - lines[end].count(")")
            end += 1
            if depth <= 0 and lines[end - 1].rstrip().endswith(":"):
                break
        path = os.path.relpath(source_file, root)
        quotes[key] = {"file": path, "line": start + hit - before, "function": qualname or "",
                       "lines": [ln.rstrip("\n") for ln in lines[hit - before:end]]}
    return quotes


# ---- main -----------------------------------------------------------------------------------------------------
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenarios", required=True)
    p.add_argument("--model", help="float32 Hugging Face folder (needed for the live v1-sync mode)")
    p.add_argument("--out", required=True)
    p.add_argument("--modes", default="v1-sync," + ",".join(SCRIPTED_MODES))
    p.add_argument("--only", default="", help="comma-separated scenario names (default: all)")
    a = p.parse_args(argv)
    with open(a.scenarios) as f:
        doc = json.load(f)
    scenarios = doc["scenarios"]
    if a.only:
        names = set(a.only.split(","))
        scenarios = [s for s in scenarios if s["name"] in names]
    for s in scenarios:
        s.setdefault("eos_token_id", doc.get("eos_token_id", 2))
    modes = [m for m in a.modes.split(",") if m]
    import vllm

    result = {
        "vllm_version": vllm.__version__,
        "recorded_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "modes": {},
        "source": read_source_quotes(),
        "notes": {
            "num_free_blocks": "vLLM's raw BlockPool.get_num_free_blocks() right after schedule(). vLLM's pool has "
                               "num_usable_blocks + 1 blocks: block 0 is its null block, taken at start-up and "
                               "never free, so the raw number counts usable blocks only, like minivllm's.",
            "block_ids": "vLLM's block ids start at 1 (0 is the null block); they are recorded, not compared.",
            "request_ids": "vLLM's engine appends a random suffix to each request id; the recording maps them "
                           "back to the scenario's ids.",
            "v2_runner": "Model Runner V2 itself cannot run here (x86 needs triton-cpu, which no registry we reach "
                         "serves): the v2 modes are vLLM's scheduler with use_v2_model_runner=True. The runner's "
                         "own semantics (a partial prefill's sample dropped by num_sampled = 0, seeded Gumbel "
                         "sampling hashed from seed and position) are cited from the installed source "
                         "(source.v2_gumbel_seed_position_hash), not run.",
            "async_scheduling": "vLLM's CPU platform resolves async_scheduling to False, so the async modes are "
                                "vLLM's AsyncScheduler driven with two steps in flight, as in vLLM's "
                                "tests/v1/core/test_async_scheduler.py.",
        },
    }
    t0 = time.time()
    if "v1-sync" in modes:
        if not a.model:
            p.error("--model is required for the v1-sync mode")
        runs, settings = record_live(scenarios, a.model)
        result["modes"]["v1-sync"] = {
            "how": "live: vLLM's LLMEngine in-process on the CPU (V1 model runner, synchronous scheduling), "
                   "greedy sampling on the float32 SmolLM2-135M-Instruct weights; a fresh vLLM Scheduler per "
                   "scenario with the scenario's settings",
            "model_runner": "v1", "async_scheduling": False, "live": True, "settings": settings,
            "scenarios": runs,
        }
    scripted = [m for m in modes if m in SCRIPTED_MODES]
    if scripted:
        import tempfile

        cfg_dir = write_tiny_config(tempfile.mkdtemp(prefix="vllm_check_cfg_"))
        runs = record_scripted(scenarios, scripted, cfg_dir)
        for m in scripted:
            v2, async_ = SCRIPTED_MODES[m]
            result["modes"][m] = {
                "how": "scheduler only: vLLM's own " + ("AsyncScheduler" if async_ else "Scheduler")
                       + " built from a V1 configuration (local config.json, no weights)"
                       + (", switched with use_v2_model_runner=True" if v2 else "")
                       + ", driven by hand-made ModelRunnerOutputs carrying the scenario's scripted tokens"
                       + (" with two steps in flight (step n+1 scheduled before step n's output is processed)"
                          if async_ else ""),
                "model_runner": "v2" if v2 else "v1", "async_scheduling": async_, "live": False,
                "scenarios": runs[m],
            }
    result["seconds"] = round(time.time() - t0, 1)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {a.out} ({result['seconds']} s)")


if __name__ == "__main__":
    main()

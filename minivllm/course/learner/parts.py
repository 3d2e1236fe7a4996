"""The parts of the engine a learner writes, one registry for the notebooks, the grader and ``your_engine``.

A *part* is a piece of the real engine, plugged in through one of vLLM's own seams: a method of a
``scheduler_cls`` subclass (``Scheduler._schedule_waiting``, ``_schedule_running``, ...), an attention backend
(``attention_backend=``) or a KV connector (``kv_connector=``). Each lesson module
(``minivllm.course.learner.lesson03`` ... ``lesson08``) registers its parts with ``register``: the name the
learner's exercise cell defines, the lesson, a one-line statement of what the learner writes, a checker and three
hints (a nudge, the idea, the line to write).

The checker contract: ``check(obj, hidden)`` runs the part against the reference on the notebook's workloads and,
with ``hidden=True``, on workloads the notebook never shows; it returns the number of cases passed, raises
``NotWritten`` while the exercise is blank, and ``PartFailed`` (an ``ExerciseFailed``) naming the first difference
(step, request, field, expected and yours side by side) otherwise.

In a notebook, ``check("waiting_loop", WaitingLoop)`` prints ``✓`` or the difference followed by the three hints,
each folded (HTML ``<details>``) so that the learner opens only as many as they need.
"""

from __future__ import annotations

import html
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from minivllm.course.exercises._harness import ExerciseFailed
from minivllm.i18n import _

LESSON_MODULES = ("lesson03", "lesson04", "lesson05", "lesson06", "lesson07", "lesson08")


class NotWritten(Exception):
    """The exercise is still blank: the learner's code raises ``NotImplementedError`` (or is missing)."""


class PartFailed(ExerciseFailed):
    """A learner's part differs from the reference. ``str()`` names the workload and the first difference."""


@dataclass
class Part:
    """One engine part a learner writes.

    Attributes:
        name: the registry key, e.g. ``"waiting_loop"``; the exercise cell starts ``# Your turn: <name>``.
        lesson: the notebook, ``"03"`` ... ``"08"``.
        symbol: the name the exercise cell defines (a class or a function), e.g. ``"WaitingLoop"``.
        kind: ``"scheduler"`` (the symbol is a ``Scheduler`` subclass overriding the part's methods only, so that
            ``your_engine`` composes every lesson's class into one ``scheduler_cls`` by inheritance),
            ``"attention"`` (a function; lesson 03's three make one attention backend), ``"runner"`` (a function
            of the model runner's input preparation) or ``"connector"`` (a ``KVConnectorBase`` subclass).
        seam: the engine seam it plugs into, in words (``"scheduler_cls: Scheduler._schedule_waiting"``).
        writes: what the learner writes, one line (English, marked with ``N_``; shown as ``_(writes)``).
        check: ``check(obj, hidden) -> int`` (see the module docstring).
        hints: a nudge, the idea, the line to write (English, each marked with ``N_`` unless it is code only;
            shown translated by ``hints_now``).
        reference: the package's own answer (a class or function in the learner's form), used by
            ``your_engine`` where the learner's part is unfinished.
    """

    name: str
    lesson: str
    symbol: str
    kind: str
    seam: str
    writes: str
    check: Callable[[Any, bool], int]
    hints: Tuple[str, str, str]
    reference: Any = None


PARTS: Dict[str, Part] = {}


def hints_now(part: Part) -> Tuple[str, ...]:
    """``part``'s three hints in the current language (a code-only hint is the same in every language)."""
    return tuple(_(h) for h in part.hints)


def register(part: Part) -> Part:
    """Add ``part`` to the registry (a lesson module calls this at import). Raises ``ValueError`` on a duplicate."""
    if part.name in PARTS and PARTS[part.name] is not part:
        raise ValueError(f"part {part.name!r} is registered twice")
    PARTS[part.name] = part
    return part


def load_all() -> Dict[str, Part]:
    """Import every lesson module (each registers its parts) and return the registry, in lesson order."""
    for m in LESSON_MODULES:
        importlib.import_module(f"minivllm.course.learner.{m}")
    return dict(sorted(PARTS.items(), key=lambda kv: (kv[1].lesson, list(PARTS).index(kv[0]))))


def get(name: str) -> Part:
    """The part called ``name``. Raises ``KeyError`` naming the known parts."""
    parts = load_all()
    if name not in parts:
        raise KeyError(f"no part {name!r}; the parts are {list(parts)}")
    return parts[name]


def parts_of(lesson: str) -> List[Part]:
    """The parts of one lesson (``"04"``), in registration order."""
    return [p for p in load_all().values() if p.lesson == lesson]


def run_check(part: Part, obj: Any, hidden: bool = True) -> Tuple[str, str]:
    """``(status, message)``: ``"passed"`` (message: how many cases), ``"blank"``, or ``"failed"`` (message:
    the first difference). Any exception of the learner's code other than ``NotImplementedError`` is a failure
    whose message names it."""
    if obj is None:
        return "blank", _("{symbol} is not defined yet").format(symbol=part.symbol)
    try:
        n = part.check(obj, hidden)
    except NotWritten as e:
        return "blank", str(e) or not_written_message(part.symbol)
    except ExerciseFailed as e:
        return "failed", str(e)
    if hidden:
        return "passed", _("{n} cases equal to the reference (hidden ones included)").format(n=n)
    return "passed", _("{n} cases equal to the reference").format(n=n)


def not_written_message(symbol: str) -> str:
    """``"<symbol> still raises NotImplementedError"``, in the current language (the text of ``NotWritten``)."""
    return _("{symbol} still raises NotImplementedError").format(symbol=symbol)


def hint_ladder_html(part: Part) -> str:
    """The three hints, each in its own folded ``<details>``, for a notebook."""
    titles = (_("Hint 1: a nudge"), _("Hint 2: the idea"), _("Hint 3: the line to write"))
    return "".join(f"<details><summary>{t}</summary><pre>{html.escape(h)}</pre></details>"
                   for t, h in zip(titles, hints_now(part)))


def check(name: str, obj: Any, hidden: bool = True) -> Optional[bool]:
    """Check a learner's part in a notebook: prints ``✓ name: ...`` and returns ``True`` when it equals the
    reference on every case; prints how to go on and returns ``None`` while it is blank; otherwise shows the first
    difference and the three folded hints, then raises ``PartFailed`` (so that "run all" stops there).

    Args:
        name: the part (``minivllm.course.learner.parts.PARTS``).
        obj: what the exercise cell defined (``part.symbol``).
        hidden: also run the hidden workloads (the grader always does).
    """
    __tracebackhide__ = True
    part = get(name)
    status, msg = run_check(part, obj, hidden)
    if status == "passed":
        print(_("✓ {name} ({symbol}): {message}").format(name=name, symbol=part.symbol, message=msg))
        return True
    if status == "blank":
        print(_("{name}: not written yet ({why}). Fill in {symbol}, run its cell, then run this cell again.").format(
            name=name, why=msg, symbol=part.symbol))
        return None
    _show_hints(part)
    raise PartFailed(_("{name} ({symbol}) differs from the reference:").format(name=name, symbol=part.symbol)
                     + f"\n{msg}")


def _show_hints(part: Part) -> None:
    try:
        from IPython import get_ipython
        from IPython.display import HTML, display
    except ImportError:  # pragma: no cover - IPython comes with the course's requirements
        return
    if get_ipython() is None:
        return
    display(HTML(hint_ladder_html(part)))


def yours_or_reference(name: str, obj: Any) -> Any:
    """What the notebook's later cells should run: the learner's ``obj`` when it passes its checker (hidden cases
    included: a part that passes only the notebook's cases, say with the notebook's block size written in, must not
    reach the engine), else the part's reference; prints which, the same line on every run.

    So every notebook runs top to bottom with its exercises blank, and shows the same results either way.
    """
    part = get(name)
    status, _msg = run_check(part, obj, hidden=True)
    if status == "passed":
        print(_("{name}: yours passes its checker, so the engine below runs yours ({symbol})").format(
            name=name, symbol=part.symbol))
        return obj
    if status == "blank":
        print(_("{name}: yours is not written yet, so the engine below runs the reference part ({reference})").format(
            name=name, reference=_ref_name(part)))
    else:
        print(_("{name}: yours does not pass its checker yet (run its check cell to see why), so the engine below "
                "runs the reference part ({reference})").format(name=name, reference=_ref_name(part)))
    return part.reference


def _ref_name(part: Part) -> str:
    r = part.reference
    return f"{getattr(r, '__module__', '?')}.{getattr(r, '__qualname__', getattr(r, '__name__', repr(r)))}"


def check_prediction(what: str, predicted: Any, actual: Any, explain: str = "") -> Optional[bool]:
    """Compare a learner's written-down prediction with what the engine just did (``actual``, computed by the
    demonstration cell, never typed in). Prints ``✓``, or both side by side and ``explain``; while ``predicted`` is
    still ``None`` it prints the actual outcome (the learner can still predict first and compare). Never raises:
    a wrong prediction is part of learning, not an error. Returns ``True``/``False``, or ``None`` when blank."""
    if predicted is None:
        print(_("{what}: no prediction written (set it above before running the demonstration). What happened: "
                "{actual}").format(what=what, actual=repr(actual)))
        return None
    if predicted == actual:
        print(_("✓ {what}: your prediction {predicted} is what happened").format(what=what, predicted=repr(predicted)))
        return True
    print(_("✗ {what}: you predicted {predicted}\n  what happened:  {actual}").format(
        what=what, predicted=repr(predicted), actual=repr(actual)))
    if explain:
        print(_("  why: {explain}").format(explain=explain))
    return False

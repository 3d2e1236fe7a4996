"""Run a learner's function on reference inputs and explain the first failure in words.

Every checker in ``minivllm.course.exercises`` follows the same contract:

* all tests pass: print one line ``✓ <name>: all N tests passed`` and return ``None``;
* the function is still the notebook's stub (it raises ``NotImplementedError``): print how to go on, return;
* anything else: raise ``ExerciseFailed`` naming the test input, the expected and the actual value, and a hint
  when the wrong answer matches a known mistake (for example RoPE rotating interleaved pairs).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from minivllm.i18n import _


class ExerciseFailed(AssertionError):
    """A learner's function gave a wrong answer. The message says which input, what was expected, what came back."""


class LearnerRaised(ExerciseFailed):
    """The learner's function raised an exception on a test input (``call``); the message names the input."""


class _NotWrittenYet(Exception):
    """The learner's function raised ``NotImplementedError`` (or a value is still ``None``): the stub has not been
    filled in. The message, if any, says what is still missing."""


@dataclass
class Variant:
    """A known wrong solution, and the hint to show when a learner's output equals its output.

    Attributes:
        fn: called with the same arguments as the learner's function.
        hint: one or two sentences: what the mistake is and how to fix it, in English, marked with ``N_`` (it is
            translated when shown, by ``matching_hint``).
    """

    fn: Callable
    hint: str


def checker(exercise: str):
    """Decorate a ``check_x(fn, ...)`` function: turn a stub into a friendly message, print success.

    The decorated function must return the number of tests it ran, and raise ``ExerciseFailed`` on failure.
    """

    def wrap(check: Callable[..., int]):
        @functools.wraps(check)
        def run(*args, **kwargs) -> None:
            __tracebackhide__ = True  # IPython and pytest hide this frame: the learner sees only the message
            try:
                n = check(*args, **kwargs)
            except _NotWrittenYet as e:
                if str(e):  # a value still at its placeholder
                    print(_("{exercise}: not done yet ({what}). Fill it in, run that cell, then run this cell "
                            "again.").format(exercise=exercise, what=e))
                else:
                    print(_("{exercise}: not written yet (it raises NotImplementedError). Fill in its body, run "
                            "that cell, then run this cell again.").format(exercise=exercise))
                return None
            print(_("✓ {exercise}: all {n} tests passed").format(exercise=exercise, n=n))
            return None

        return run

    return wrap


def call(fn: Callable, args: Sequence[Any], exercise: str, case: str) -> Any:
    """Call the learner's ``fn(*args)``; an exception becomes ``ExerciseFailed`` naming the input."""
    __tracebackhide__ = True
    try:
        return fn(*args)
    except NotImplementedError:
        raise _NotWrittenYet() from None
    except Exception as e:  # noqa: BLE001 - any error of the learner's code is reported, not re-raised raw
        raise LearnerRaised(
            _("{exercise} raised {error} on the test input {case}:").format(
                exercise=exercise, error=type(e).__name__, case=case) + f"\n    {e}"
        ) from None


def fail(exercise: str, case: str, problem: str, hint: Optional[str] = None) -> None:
    """Raise ``ExerciseFailed`` with the standard layout (test input, what is wrong, hint); ``case``, ``problem``
    and ``hint`` come already in the current language."""
    __tracebackhide__ = True
    msg = _("{exercise} is wrong on the test input {case}:").format(exercise=exercise, case=case) + f"\n    {problem}"
    if hint:
        msg += "\n  " + _("Hint: {hint}").format(hint=hint)
    raise ExerciseFailed(msg)


def hint_label() -> str:
    """The word that starts a hint line in ``fail``'s messages, in the current language (``"Hint:"``), so that
    code adding a hint of its own can tell whether the message has one already."""
    return _("Hint: {hint}").format(hint="").strip()


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def compare_tensors(
    expected: torch.Tensor,
    got: Any,
    what: str = "output",
    atol: float = 1e-5,
    rtol: float = 1e-4,
    equal_nan: bool = False,
) -> Optional[str]:
    """``None`` if ``got`` equals ``expected`` within tolerance, else one sentence saying how it differs.

    Checks, in order: is a tensor, shape, dtype, values (NaN matches only with ``equal_nan``). For a value
    mismatch it names the first differing index with both values, how many entries differ and the largest
    difference.
    """
    if not isinstance(got, torch.Tensor):
        return _("{what} should be a torch.Tensor, got {type}").format(what=what, type=type(got).__name__)
    if tuple(got.shape) != tuple(expected.shape):
        return _("{what} has shape {shape}, expected {expected}").format(what=what, shape=list(got.shape),
                                                                         expected=list(expected.shape))
    if got.dtype != expected.dtype:
        return _("{what} has dtype {dtype}, expected {expected}").format(what=what, dtype=got.dtype,
                                                                         expected=expected.dtype)
    g = got.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    bad = ~torch.isclose(g, e, rtol=rtol, atol=atol, equal_nan=equal_nan)
    if not bool(bad.any()):
        return None
    idx = tuple(int(i) for i in bad.nonzero()[0])
    diff = (g - e).abs().nan_to_num(nan=float("inf")).max().item()
    where = f"[{', '.join(map(str, idx))}]" if idx else ""
    msg = _("{what}{where} is {got}, expected {expected} ({bad} of {total} entries differ; largest difference "
            "{diff}, tolerance atol={atol}, rtol={rtol})").format(
        what=what, where=where, got=_fmt(g[idx].item()), expected=_fmt(e[idx].item()), bad=int(bad.sum()),
        total=bad.numel(), diff=_fmt(diff), atol=f"{atol:g}", rtol=f"{rtol:g}")
    if e.numel() <= 8:
        exp_vals = [round(v, 5) for v in e.flatten().tolist()]
        got_vals = [round(v, 5) for v in g.flatten().tolist()]
        msg += _("\n    expected {expected}\n    got      {got}").format(expected=exp_vals, got=got_vals)
    return msg


def matching_hint(
    got: Any, args: Sequence[Any], variants: Iterable[Variant], compare: Callable[[Any, Any], Optional[str]]
) -> Optional[str]:
    """The hint of the first known-wrong variant whose output on ``args`` equals ``got`` (in the current
    language), else ``None``."""
    for v in variants:
        try:
            wrong = v.fn(*clone_args(args))
        except Exception:  # noqa: BLE001 - a variant that cannot run on this input just does not match
            continue
        if compare(wrong, got) is None:
            return _(v.hint)
    return None


def clone_args(args: Sequence[Any]) -> list:
    """Fresh copies of tensor arguments (and of lists), so a function that modifies its input cannot affect the
    next call or the expected value."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a.clone())
        elif isinstance(a, list):
            out.append(list(a))
        elif isinstance(a, dict):
            out.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in a.items()})
        else:
            out.append(a)
    return out


def check_cases(
    exercise: str,
    fn: Callable,
    cases: Sequence[tuple],
    variants: Sequence[Variant] = (),
    atol: float = 1e-5,
    rtol: float = 1e-4,
    general_hint: Optional[str] = None,
) -> int:
    """Run ``fn`` on ``(description, args, expected)`` cases and compare tensors; returns the number of cases.

    The descriptions and ``general_hint`` come already in the current language; the variants' hints are
    translated when shown."""
    __tracebackhide__ = True
    for desc, args, expected in cases:
        got = call(fn, clone_args(args), exercise, desc)
        problem = compare_tensors(expected, got, atol=atol, rtol=rtol)
        if problem is not None:
            cmp = lambda a, b: compare_tensors(a, b, atol=atol, rtol=rtol, equal_nan=True)  # noqa: E731
            hint = matching_hint(got, args, variants, cmp) if isinstance(got, torch.Tensor) else None
            fail(exercise, desc, problem, hint or general_hint)
    return len(cases)


def not_written(value: Any, name: str) -> None:
    """Raise the harness's "not written yet" signal if ``value`` (called ``name``) is still a notebook's
    placeholder (``None`` or ``...``)."""
    if value is None or value is Ellipsis:
        raise _NotWrittenYet(_("{name} is still {value}").format(name=name, value=repr(value)))


def use_yours_or_reference(yours: Any, reference: Any, check: Callable, *args: Any, **kwargs: Any) -> Any:
    """``yours`` if it passes ``check`` (a ``check_x`` checker, run silently), else ``reference``.

    For the cells after an exercise that build on the learner's function: the notebook runs top to bottom with the
    exercise unfilled and shows the same results. Prints one line saying which is used (and why not yours), the
    same line on every run. ``args``/``kwargs`` go to the checker after ``yours`` (e.g. ``model=model``).
    """
    name = getattr(reference, "__name__", "?")
    where = f"{reference.__module__}.{name}"
    if yours is reference:
        print(_("{name}: the cells below use the package's reference ({where}); run your exercise cell again to "
                "use yours").format(name=name, where=where))
        return reference
    try:
        check.__wrapped__(yours, *args, **kwargs)
    except _NotWrittenYet:
        print(_("{name}: not written yet, so the cells below use the package's reference ({where})").format(
            name=name, where=where))
        return reference
    except Exception:  # noqa: BLE001 - any failure of the learner's code means: not yet
        print(_("{name}: yours does not pass its checker yet (run its cell to see why), so the cells below use the "
                "package's reference ({where})").format(name=name, where=where))
        return reference
    print(_("{name}: yours passes its checker, so the cells below use yours").format(name=name))
    return yours

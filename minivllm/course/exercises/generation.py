"""Checker for notebook 01's greedy generation loop (no KV cache: every step recomputes the whole sequence)."""

from __future__ import annotations

from typing import Callable, List

import torch

from minivllm.course.exercises._harness import call, checker, fail
from minivllm.i18n import N_, _

_VOCAB = 50


def _next_token(seq: List[int]) -> int:
    # A rule that depends on the whole sequence (its length and last token), so a loop that feeds the model only
    # part of the sequence, or reads the wrong row of logits, gets different tokens.
    return (3 * seq[-1] + len(seq)) % _VOCAB


class _FakeModel:
    """``forward(token_ids) -> logits [len(token_ids), vocab]``; row ``i`` predicts the token after position ``i``.

    Records every call, so the checker can tell whether the loop passed the whole sequence each time.
    """

    def __init__(self) -> None:
        self.calls: List[List[int]] = []

    def __call__(self, token_ids) -> torch.Tensor:
        ids = [int(t) for t in token_ids]
        self.calls.append(ids)
        logits = torch.empty(len(ids), _VOCAB)
        cols = torch.arange(_VOCAB)
        for i in range(len(ids)):
            target = _next_token(ids[: i + 1])
            logits[i] = -((cols - target) % _VOCAB).float()  # unique maximum at `target`
        return logits


def _reference(prompt, n, eos, *, row=-1, stop_at_eos=True, keep_eos=True, extra=0, with_prompt=False):
    seq = list(prompt)
    out: List[int] = []
    for _step in range(n + extra):
        tok = _next_token(seq if row == -1 else seq[:1])
        if stop_at_eos and eos is not None and tok == eos and not keep_eos:
            break
        out.append(tok)
        seq.append(tok)
        if stop_at_eos and eos is not None and tok == eos:
            break
    return list(prompt) + out if with_prompt else out


#: Known mistakes: (the switches of ``_reference`` that make it, the hint in English; translated where shown).
_MISTAKES = [
    (dict(with_prompt=True), N_("return only the newly generated tokens, not the prompt followed by them.")),
    (dict(row=0), N_("the next token comes from the logits of the *last* position: logits[-1].argmax().")),
    (dict(stop_at_eos=False), N_("stop as soon as the generated token equals eos_token_id (after appending it).")),
    (dict(keep_eos=False), N_("keep the EOS token in the output, as vLLM does in token_ids, then stop.")),
    (dict(extra=1), N_("generate at most max_new_tokens tokens (one too many here).")),
    (dict(extra=-1), N_("generate max_new_tokens tokens (one too few here).")),
]


@checker("greedy_generate")
def check_greedy_generate(fn: Callable) -> int:
    """Check ``fn(forward, prompt_ids, max_new_tokens, eos_token_id) -> new_token_ids`` (greedy, no cache).

    ``forward(token_ids: list[int])`` returns logits ``[num_rows, vocab]`` whose last row predicts the next token;
    the loop appends ``argmax`` of that row and calls ``forward`` again on the whole, longer sequence. It stops
    after ``max_new_tokens`` tokens, or right after emitting ``eos_token_id`` (kept in the output) unless that is
    ``None``. The returned list holds only the new tokens, and ``prompt_ids`` must not be modified.

    The checker uses a fake model with a 50-token vocabulary whose next token depends on the whole sequence.

    Raises:
        ExerciseFailed: naming the failing input, expected and actual tokens, and a hint for known mistakes.
    """
    base = [5, 9, 2]
    free_run = _reference(base, 8, None)
    eos = free_run[2]
    assert eos not in free_run[:2]  # the test below needs EOS to appear first at the third token
    cases = [
        ("prompt [5, 9, 2], max_new_tokens=6, eos_token_id=None", base, 6, None),
        ("prompt [1], max_new_tokens=4, eos_token_id=None", [1], 4, None),
        (_("prompt [5, 9, 2], max_new_tokens=8, eos_token_id={eos} (generated as the 3rd token)").format(eos=eos),
         base, 8, eos),
        ("prompt [7, 7], max_new_tokens=1, eos_token_id=None", [7, 7], 1, None),
    ]
    for desc, prompt, n, e in cases:
        model = _FakeModel()
        prompt_arg = list(prompt)
        got = call(fn, (model, prompt_arg, n, e), "greedy_generate", desc)
        if prompt_arg != prompt:
            fail("greedy_generate", desc, _("prompt_ids was changed in place to {prompt}").format(prompt=prompt_arg),
                 _("copy the prompt first (seq = list(prompt_ids)) and append to the copy."))
        try:
            got_list = [int(t) for t in (got.tolist() if isinstance(got, torch.Tensor) else got)]
        except Exception:  # noqa: BLE001
            fail("greedy_generate", desc, _("expected a list of token ids, got {type}: {value}").format(
                type=type(got).__name__, value=repr(got)))
        expected = _reference(prompt, n, e)
        if got_list != expected:
            hint = next((_(h) for kw, h in _MISTAKES if _reference(prompt, n, e, **kw) == got_list), None)
            if hint is None and model.calls and any(len(c) < len(prompt) + i for i, c in enumerate(model.calls)):
                hint = _("without a cache, pass the whole sequence (prompt + tokens so far) to forward at every step.")
            fail("greedy_generate", desc, _("expected tokens {expected}, got {got}").format(expected=expected, got=got_list), hint)
        expected_calls = [list(prompt) + expected[:i] for i in range(len(expected))]
        if model.calls != expected_calls:
            fail("greedy_generate", desc,
                 _("forward was called {n} times with sequence lengths {lengths}; expected {expected_n} calls with "
                   "lengths {expected_lengths}").format(n=len(model.calls), lengths=[len(c) for c in model.calls],
                                                       expected_n=len(expected_calls),
                                                       expected_lengths=[len(c) for c in expected_calls]),
                 _("call forward once per generated token, on prompt + all tokens generated so far."))
    return len(cases)


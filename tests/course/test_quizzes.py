"""Every notebook ends with a quiz (issue 26: "Quizzes ('check your understanding', hidden answers) in every notebook
00-13"), checked in milliseconds: its form, not its content (each answer is checked by hand against the notebook's
own outputs when it is written).

A quiz is one markdown cell that starts with ``## Check your understanding``, holds 3-5 numbered questions
(``**1. ...?**``), each followed by its answer folded in ``<details><summary>Answer</summary> ... </details>``,
and comes after the notebook's lessons: the only markdown after it is the ``## 中文小结``.
"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))

HEADING = "## Check your understanding\n"
QUESTION = re.compile(r"^\*\*(\d+)\. (.+)\*\*$", re.M)
ANSWER = re.compile(r"\A\s*<details><summary>Answer</summary>\n(.+?)</details>\s*\Z", re.S)
MIN_QUESTIONS, MAX_QUESTIONS = 3, 5



def _src(cell):
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def quiz_problems(cells):
    """What is wrong with the quiz of a notebook's ``cells`` (a list of nbformat cell dicts): [] when nothing."""
    quizzes = [i for i, c in enumerate(cells) if c["cell_type"] == "markdown" and _src(c).startswith(HEADING)]
    if len(quizzes) != 1:
        return [f"{len(quizzes)} markdown cells start with {HEADING.strip()!r}; want exactly one"]
    at = quizzes[0]
    text = _src(cells[at])[len(HEADING):]
    problems = []
    later = [i for i, c in enumerate(cells[at + 1:], start=at + 1) if c["cell_type"] == "markdown"]
    if [_src(cells[i]).split("\n", 1)[0] for i in later] != ["## 中文小结"]:
        problems.append(f"cell {at}: the only markdown after the quiz must be the '## 中文小结' (cells {later})")
    questions = list(QUESTION.finditer(text))
    if text[:questions[0].start()].strip() if questions else True:
        problems.append(f"cell {at}: the quiz must go straight to its first question '**1. ...?**'")
    numbers = [int(q.group(1)) for q in questions]
    if numbers != list(range(1, len(numbers) + 1)) or not MIN_QUESTIONS <= len(numbers) <= MAX_QUESTIONS:
        problems.append(f"cell {at}: questions numbered {numbers}; want 1, 2, ... with "
                        f"{MIN_QUESTIONS}-{MAX_QUESTIONS} questions")
    for k, q in enumerate(questions):
        if not q.group(2).rstrip().endswith("?"):
            problems.append(f"cell {at}, question {q.group(1)}: does not end with '?'")
        body = text[q.end():questions[k + 1].start() if k + 1 < len(questions) else len(text)]
        answer = ANSWER.match(body)
        if answer is None:
            problems.append(f"cell {at}, question {q.group(1)}: want the answer, and nothing else, folded in "
                            "<details><summary>Answer</summary> ... </details>")
        elif len(re.findall(r"\w+", answer.group(1))) < 5 or "<details" in answer.group(1):
            problems.append(f"cell {at}, question {q.group(1)}: the folded answer is empty or holds another fold")
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_notebook_ends_with_a_quiz_with_folded_answers(path):
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    assert quiz_problems(cells) == [], path.name


def _md(text):
    return {"cell_type": "markdown", "metadata": {}, "source": text}


GOOD_QUIZ = HEADING + "\n" + "\n".join(
    f"**{k}. Question number {k}?**\n\n<details><summary>Answer</summary>\n\nThe answer to question {k}, in words.\n\n"
    "</details>\n" for k in (1, 2, 3))


@pytest.mark.parametrize("quiz, why", [
    (None, "no quiz"),
    (GOOD_QUIZ.replace("<details><summary>Answer</summary>\n\nThe answer to question 2, in words.\n\n</details>",
                       "The answer to question 2, in words."), "an answer not folded"),
    (GOOD_QUIZ.replace("<details><summary>Answer</summary>", "<details open><summary>Answer</summary>"),
     "answers shown open"),
    (GOOD_QUIZ.replace("The answer to question 3, in words.", ""), "an empty answer"),
    (GOOD_QUIZ.split("**3.")[0], "two questions"),
    (GOOD_QUIZ.replace("**3.", "**4."), "numbers skip"),
    (GOOD_QUIZ.replace("number 2?", "number 2."), "a question without '?'"),
])
def test_quiz_problems_finds_a_missing_or_broken_quiz(quiz, why):
    summary = _md("## 中文小结\n小结。")
    cells = [_md("# 99 · T"), _md("## 中文导读\n导读。"), _md("## 1. Part\ntext")]
    assert quiz_problems(cells + [_md(GOOD_QUIZ), summary]) == []
    assert quiz_problems(cells + ([_md(quiz)] if quiz else []) + [summary]), why
    # placement: a quiz in the middle of the lesson, or two quizzes, is refused too
    assert quiz_problems(cells[:2] + [_md(GOOD_QUIZ)] + cells[2:] + [summary])
    assert quiz_problems(cells + [_md(GOOD_QUIZ), _md(GOOD_QUIZ), summary])

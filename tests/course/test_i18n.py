"""The language switch (``minivllm.i18n``) and the package's message catalog (issue 30): the catalog is complete and
compiled, a bad language changes nothing, and the checkers' messages follow the switch at call time (Chinese under
``zh_CN``, the same English as before under ``en``)."""

import io
import re
import string

import pytest
from babel.messages.pofile import read_po

from minivllm import i18n
from minivllm.course import i18n_catalog
from minivllm.i18n import ljust, text_width
from minivllm.course.learner import grade as grade_mod
from minivllm.course.learner import parts


@pytest.fixture
def english_after():
    """Whatever a test switches to, the next test starts in English (the default)."""
    yield
    i18n.set_language("en")


def _wrong_slot_mapping(block_table, positions, block_size):
    return [block_table[p // block_size] + p % block_size for p in positions]  # forgets * block_size


def _blank_slot_mapping(block_table, positions, block_size):
    raise NotImplementedError


def test_catalog_is_complete_and_current():
    assert i18n_catalog.problems() == []


def test_catalog_translations_keep_every_placeholder():
    """A msgstr that drops or renames a ``{name}`` would raise KeyError (or lose a value) at ``.format`` time."""
    with open(i18n_catalog.po_path("zh_CN"), "rb") as f:
        catalog = read_po(f, locale="zh_CN")

    def names(s):
        return sorted(n for _t, n, _s, _c in string.Formatter().parse(s) if n is not None)

    checked = 0
    for m in catalog:
        if not m.id:
            continue
        ids = m.id if isinstance(m.id, tuple) else (m.id,)
        strs = m.string if isinstance(m.string, tuple) else (m.string,)
        for s in strs:
            assert names(s) in [names(i) for i in ids], (m.id, s)
            checked += 1
    assert checked >= 350  # the checkers' and grader's messages alone are 352


def test_set_language_rejects_an_unknown_language_and_changes_nothing(english_after):
    i18n.set_language("zh_CN")
    before = parts.run_check(parts.get("slot_mapping"), None)
    with pytest.raises(ValueError, match=r"en, zh_CN") as e:
        i18n.set_language("fr")
    assert "'fr'" in str(e.value)
    assert i18n.get_language() == "zh_CN"
    assert parts.run_check(parts.get("slot_mapping"), None) == before == ("blank", "slot_mapping 还没有定义")


def test_blank_part_prints_chinese_under_zh_and_the_old_english_under_en(english_after, capsys):
    assert parts.check("slot_mapping", _blank_slot_mapping) is None
    assert capsys.readouterr().out == (
        "slot_mapping: not written yet (slot_mapping still raises NotImplementedError). Fill in slot_mapping, run "
        "its cell, then run this cell again.\n")
    i18n.set_language("zh_CN")
    assert parts.check("slot_mapping", _blank_slot_mapping) is None
    assert capsys.readouterr().out == (
        "slot_mapping：还没有写（slot_mapping 仍然抛出 NotImplementedError）。把 slot_mapping 写好，运行它的单元格，"
        "再运行这个单元格。\n")


def test_wrong_slot_mapping_is_explained_in_the_current_language(english_after):
    with pytest.raises(parts.PartFailed) as e:
        parts.check("slot_mapping", _wrong_slot_mapping, hidden=False)
    assert str(e.value) == (
        "slot_mapping (slot_mapping) differs from the reference:\n"
        "slot_mapping is wrong on the test input block_table=[3], positions=[0, 1, 2], block_size=4:\n"
        "    expected slots [12, 13, 14], got [3, 4, 5]\n"
        "  Hint: a block holds block_size slots: multiply the block id by block_size.")
    i18n.set_language("zh_CN")
    with pytest.raises(parts.PartFailed) as e:
        parts.check("slot_mapping", _wrong_slot_mapping, hidden=False)
    text = str(e.value)
    assert "与参考实现不同" in text and "槽位应为 [12, 13, 14]，实际是 [3, 4, 5]" in text
    assert "提示：一个块有 block_size 个槽位" in text  # a module-level hint, translated when shown
    assert not re.search(r"\b(expected|Hint|wrong)\b", text)


def test_module_level_hints_follow_the_switch(english_after):
    part = parts.get("waiting_loop")
    english = parts.hints_now(part)
    assert english == part.hints
    i18n.set_language("zh_CN")
    chinese = parts.hints_now(part)
    assert chinese[0] != english[0] and "循环" in chinese[0]
    assert chinese[2] == english[2]  # the line to write is code: the same in both languages
    assert "提示 1：先指个方向" in parts.hint_ladder_html(part)
    i18n.set_language("en")
    assert parts.hints_now(part) == english


def test_ljust_counts_a_chinese_character_as_two_columns():
    assert ljust("part", 8) == "part".ljust(8)
    assert ljust("部件", 8) == "部件    " and text_width(ljust("部件", 8)) == 8
    assert ljust("too long", 3) == "too long"


def test_grade_table_columns_stay_aligned_in_chinese(english_after):
    part = parts.get("waiting_loop")
    results = [(part, "blank", "", 0.0), (parts.get("slot_mapping"), "passed", "", 1.25)]
    for lang, status_word in (("en", "status"), ("zh_CN", "状态")):
        i18n.set_language(lang)
        out = io.StringIO()
        grade_mod._print_table(results, ["03", "04"], out, solutions=False)
        lines = out.getvalue().splitlines()
        header = next(x for x in lines if status_word in x)
        rows = [x for x in lines if x.startswith(("03 ", "04 "))]
        col = text_width(header[:header.index(status_word)])
        for row in rows:
            mark = next(m for m in (i18n._(grade_mod.STATUS_MARK[s]) for s in ("blank", "passed")) if m in row)
            assert text_width(row[:row.index(mark)]) == col, (lang, row)


def test_workload_names_stay_keys_and_are_shown_in_the_current_language(english_after):
    from minivllm.course.learner import compare, lesson04, lesson05, lesson08

    w = lesson04.NOTEBOOK_WORKLOADS[1]
    english = compare.describe(w)
    assert english.startswith("'whole prompt' (block_size=4, ")
    i18n.set_language("zh_CN")
    assert w["name"] == "whole prompt"  # the key the checkers and the notebook use does not change
    assert [s["name"] for s in lesson08.SCENARIOS][0] == "1: B shares two blocks with a saved prompt"
    assert compare.describe(w).startswith("'整段 prompt'（block_size=4, ")
    assert compare.display_name("hidden 606.3") == "隐藏用例 606.3"
    assert compare.display_name("hidden priority 608.1") == "隐藏用例（priority 策略）608.1"
    assert compare.display_name("hidden: preemption and resume, step 7") == "隐藏用例：抢占与恢复，第 7 步"
    assert compare.display_name("3: C is preempted twice (10 blocks of 4)") == "3：C 被抢占两次（10 个块，每块 4 个 token）"
    assert compare.display_name("not a marked name") == "not a marked name"
    assert compare.display_name("") == ""  # not the catalog's header
    case = lesson05.hidden_batch_cases()[0]
    assert case.name == "hidden: many requests, block size 4, step 0"
    i18n.set_language("en")
    assert compare.describe(w) == english
    assert compare.display_name("hidden priority 608.1") == "hidden priority 608.1"
    assert compare.display_name("hidden: preemption and resume, step 7") == "hidden: preemption and resume, step 7"


def test_recording_titles_and_comparison_lines_follow_the_switch(english_after):
    from minivllm.bench.vllm_check import compare
    from minivllm.course import vllm_recordings as vr

    assert list(vr.MODE_TITLES) == ["v1-sync", "v1-async", "v2-sync", "v2-async"]
    assert vr.MODE_TITLES["v1-sync"] == "vLLM 0.32, V1 model runner, synchronous (live engine)"
    assert compare.compare_run({"steps": [{}, {}]}, {"steps": [{}, {}]}, live=False) == (True, "2 steps equal")
    short = compare.compare_run({"steps": [{}, {}]}, {"steps": [{}]}, live=False)[1]
    assert short.startswith("first difference at step 1 (vLLM has 2 steps, minivllm 1):\n")
    i18n.set_language("zh_CN")
    assert vr.MODE_TITLES["v2-async"] == ("vLLM 0.32，Model Runner V2，异步调度（vLLM 的 AsyncScheduler，"
                                          "输出按脚本给定）")
    assert compare.compare_run({"steps": [{}, {}]}, {"steps": [{}, {}]}, live=False) == (True, "2 步全部一致")
    short = compare.compare_run({"steps": [{}, {}]}, {"steps": [{}]}, live=False)[1]
    assert short.startswith("第一处不同在第 1 步（vLLM 共 2 步，minivllm 共 1 步）：\n")
    with pytest.raises(KeyError):
        vr.MODE_TITLES["v3-sync"]


def _right_slot_mapping(block_table, positions, block_size):
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


def test_passed_part_line_follows_the_switch(english_after, capsys):
    assert parts.check("slot_mapping", _right_slot_mapping, hidden=False) is True
    english = capsys.readouterr().out
    assert english.startswith("✓ slot_mapping (slot_mapping): ")
    i18n.set_language("zh_CN")
    assert parts.check("slot_mapping", _right_slot_mapping, hidden=False) is True
    assert capsys.readouterr().out.startswith("✓ slot_mapping（slot_mapping）：")


def test_step_profile_categories_are_keys_in_english_and_shown_in_chinese(english_after):
    from minivllm import LLMEngine, SamplingParams
    from minivllm.bench.step_profile import CATEGORIES, OVERHEAD, profile_step

    eng = LLMEngine("tiny")
    eng.add_request("a", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    english = profile_step(eng)
    assert set(english.by_category) == {label for label, _keys in CATEGORIES} | {
        "other tensor ops (norms, RoPE, SiLU, copies)", OVERHEAD}
    import matplotlib

    family = list(matplotlib.rcParams["font.family"])
    i18n.set_language("zh_CN")
    try:
        chinese = profile_step(eng)  # also adds the CJK font, for the notebook's own plot of these labels
        assert "Noto Sans CJK SC" in matplotlib.rcParams["font.family"]
    finally:
        matplotlib.rcParams["font.family"] = family
    assert "注意力：KV 收集（gather）" in chinese.by_category and "Python + 分派（没有算子在运行）" in chinese.by_category
    assert len(chinese.by_category) == len(english.by_category)
    assert OVERHEAD == "Python + dispatch (no operator running)"  # the constant stays the English key


def test_the_connector_call_purposes_are_the_docstrings_notebook_08_shows():
    """Notebook 08 tabulates each KV connector call with the first sentence of its KVConnectorBase docstring, through
    ``_()``; ``CALL_PURPOSE`` holds the same sentences for the catalog, so a changed docstring must change it too."""
    import inspect

    from minivllm.course.recording_connector import CALL_PURPOSE, SCHEDULER_CALLS, WORKER_CALLS
    from minivllm.distributed.kv_transfer.base import KVConnectorBase

    for name in SCHEDULER_CALLS + WORKER_CALLS:
        doc = inspect.getdoc(getattr(KVConnectorBase, name)) or ""
        assert CALL_PURPOSE[name] == doc.split(". ")[0].replace("\n", " ").replace("``", "`").rstrip("."), name
    try:
        i18n.set_language("zh_CN")
        assert all(re.search(r"[\u4e00-\u9fff]", i18n._(CALL_PURPOSE[n])) for n in CALL_PURPOSE)
    finally:
        i18n.set_language("en")

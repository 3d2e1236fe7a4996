"""The gettext catalog of the package's own messages (``minivllm/locale``), kept with Babel.

* ``python -m minivllm.course.i18n_catalog update``: extract every message marked ``_("...")``, ``N_("...")``
  (a constant translated where it is printed), ``ngettext("...", "...", n)`` or ``L_("...")`` (a table label,
  extracted with the gettext context ``minivllm.i18n.TABLE_LABEL``) in ``minivllm/**.py`` and in the English
  notebooks' code cells (Babel's Python extractor, the ``pybabel extract`` one), and the scenarios' descriptions
  in ``scenarios.json`` (:func:`data_messages`), into
  ``minivllm/locale/minivllm.pot``, then merge it into ``zh_CN/LC_MESSAGES/minivllm.po``: new messages empty,
  changed ones fuzzy with their old text as ``#| msgid``, gone ones dropped (Babel's ``Catalog.update``);
* ``compile``: write ``minivllm.mo`` from the ``.po`` (what :mod:`minivllm.i18n` loads, with the standard
  library's ``gettext`` only);
* ``check``: exit 1, listing them, if a message is untranslated or fuzzy, or the ``.mo`` or ``.pot`` is not
  what the sources and the ``.po`` give now (tests/course/test_i18n.py runs the same check).

A translator edits the ``.po`` (any PO editor, or by hand), then runs ``compile``.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path
from typing import List, Optional

from minivllm.i18n import DOMAIN, LOCALE_DIR, TABLE_LABEL

PACKAGE_DIR = Path(__file__).resolve().parents[1]
POT = LOCALE_DIR / f"{DOMAIN}.pot"
LOCALES = ("zh_CN",)
KEYWORDS = {"_": None, "ngettext": (1, 2), "N_": None}
# Babel's keyword specs take a context only from an argument; L_("label") has a fixed one, so its messages are
# extracted in a pass of their own and given that context.
LABEL_KEYWORDS = {"L_": None}


def po_path(locale: str) -> Path:
    return LOCALE_DIR / locale / "LC_MESSAGES" / f"{DOMAIN}.po"


def mo_path(locale: str) -> Path:
    return LOCALE_DIR / locale / "LC_MESSAGES" / f"{DOMAIN}.mo"


def template():
    """The catalog of every marked message in the package's sources, sorted by file and line."""
    from babel.messages.catalog import Catalog
    from babel.messages.extract import extract_from_dir

    catalog = Catalog(project="minivllm", version=None, creation_date=None, fuzzy=False)
    for keywords, fixed_context in ((KEYWORDS, None), (LABEL_KEYWORDS, TABLE_LABEL)):
        found = extract_from_dir(str(PACKAGE_DIR), method_map=[("**.py", "python")], keywords=keywords,
                                 comment_tags=("Translators:",), strip_comment_tags=True)
        for filename, lineno, message, comments, context in found:
            catalog.add(message, None, [(f"minivllm/{filename}", lineno)], auto_comments=comments,
                        context=fixed_context or context)
        for location, message, comments, context in notebook_messages(keywords):
            catalog.add(message, None, [(location, 0)], auto_comments=comments, context=fixed_context or context)
    for location, message in data_messages():
        catalog.add(message, None, [(location, 0)])
    return catalog


def data_messages():
    """``(location, message)`` of the learner-facing text kept in data files rather than code: what each live-check
    scenario shows (``scenarios.json``'s ``"shows"``, printed by ``minivllm.course.vllm_recordings.shows``)."""
    from minivllm.bench.vllm_check import load_scenarios

    for s in load_scenarios()["scenarios"]:
        if s.get("shows"):
            yield f"minivllm/bench/vllm_check/scenarios.json#{s['name']}", s["shows"]


def notebook_messages(keywords=KEYWORDS):
    """``(location, message, comments, context)`` of every message marked with one of ``keywords`` (Babel's
    keyword specs; default ``_``, ``N_``, ``ngettext``) in the English notebooks' code cells: the labels, titles and prediction texts that a notebook's own code prints or draws. The code cells
    are the same in both editions; ``_`` (``from minivllm.i18n import _``) gives the Chinese edition its Chinese.
    """
    import json

    from babel.messages.extract import extract

    notebooks = PACKAGE_DIR.parent / "notebooks"
    paths = sorted(notebooks.glob("[0-9][0-9]_*.ipynb")) + sorted((notebooks / "solutions").glob("*.ipynb"))
    for path in paths:
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            if cell["cell_type"] != "code":
                continue
            src = "".join(cell["source"])
            if not any(f"{k}(" in src for k in keywords):
                continue
            # IPython lines (%magic, !shell) are not Python: blanked so that the extractor reads the rest
            code = "\n".join("" if ln.lstrip().startswith(("%", "!")) else ln for ln in src.splitlines())
            where = f"{path.relative_to(notebooks.parent).as_posix()}#{cell['id']}"
            for _lineno, message, comments, context in extract("python", io.BytesIO(code.encode("utf-8")),
                                                                keywords=keywords, comment_tags=("Translators:",),
                                                                strip_comment_tags=True):
                yield where, message, comments, context


def _po_bytes(catalog, **kw) -> bytes:
    from babel.messages.pofile import write_po

    buf = io.BytesIO()
    write_po(buf, catalog, width=0, include_lineno=False, **kw)
    return buf.getvalue()


def _mo_bytes(catalog) -> bytes:
    from babel.messages.mofile import write_mo

    buf = io.BytesIO()
    write_mo(buf, catalog)
    return buf.getvalue()


def _read(path: Path, locale: Optional[str] = None):
    from babel.messages.pofile import read_po

    with open(path, "rb") as f:
        return read_po(f, locale=locale)


def _stable(catalog) -> None:
    # Fixed dates: a rerun with no change to the messages rewrites nothing.
    from datetime import datetime, timezone

    catalog.creation_date = catalog.revision_date = datetime(2026, 1, 1, tzinfo=timezone.utc)


def update() -> None:
    from babel.messages.catalog import Catalog

    pot = template()
    _stable(pot)
    POT.parent.mkdir(parents=True, exist_ok=True)
    POT.write_bytes(_po_bytes(pot, omit_header=False))
    for locale in LOCALES:
        path = po_path(locale)
        catalog = _read(path, locale) if path.exists() else Catalog(locale=locale, project="minivllm", version=None)
        catalog.update(pot, no_fuzzy_matching=False)
        catalog.obsolete.clear()
        _stable(catalog)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_po_bytes(catalog, include_previous=True))


def compile_catalogs() -> None:
    for locale in LOCALES:
        mo_path(locale).write_bytes(_mo_bytes(_read(po_path(locale), locale)))


def problems() -> List[str]:
    """Untranslated and fuzzy messages, and a ``.pot``/``.mo`` out of date, as lines."""
    out = []
    pot = template()
    stored_pot = {(m.id if isinstance(m.id, str) else m.id[0], m.context) for m in _read(POT) if m.id} \
        if POT.exists() else set()
    now = {(m.id if isinstance(m.id, str) else m.id[0], m.context) for m in pot if m.id}
    if stored_pot != now:
        out.append(f"{POT.relative_to(PACKAGE_DIR.parent)} is out of date "
                   f"({len(now - stored_pot)} new, {len(stored_pot - now)} gone): "
                   "run python -m minivllm.course.i18n_catalog update")
    for locale in LOCALES:
        catalog = _read(po_path(locale), locale)
        ids = {(m.id if isinstance(m.id, str) else m.id[0], m.context) for m in catalog if m.id}
        for key in sorted(now - ids, key=str):
            out.append(f"{locale}: not in the .po yet: {key[0][:70]!r} (run update)")
        for m in catalog:
            if not m.id:
                continue
            first = (m.id if isinstance(m.id, str) else m.id[0])[:70]
            strings = m.string if isinstance(m.string, tuple) else (m.string,)
            if m.fuzzy:
                out.append(f"{locale}: fuzzy (its English changed): {first!r}")
            elif not all(strings):
                out.append(f"{locale}: untranslated: {first!r}")
        if not mo_path(locale).exists() or mo_path(locale).read_bytes() != _mo_bytes(catalog):
            out.append(f"{mo_path(locale).relative_to(PACKAGE_DIR.parent)} is not compiled from the .po: "
                       "run python -m minivllm.course.i18n_catalog compile")
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minivllm.course.i18n_catalog", description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["update", "compile", "check"])
    args = ap.parse_args(argv)
    if args.command == "update":
        update()
        return 0
    if args.command == "compile":
        compile_catalogs()
        return 0
    found = problems()
    print("\n".join(found) if found else "the catalogs are complete and current")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

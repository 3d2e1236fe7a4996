"""The language of minivllm's learner-facing text: English (the default) or Chinese (``zh_CN``), through gettext.

One switch, read by every translated message when it is formatted: :func:`set_language` (``"en"`` or ``"zh_CN"``),
or the environment variable ``MINIVLLM_LANG`` read at import. The Chinese notebooks (``notebooks/zh-CN/``) call
``set_language("zh_CN")`` in their first code cell.

Messages are marked with :func:`_` (``gettext``) and :func:`ngettext` (:func:`N_` marks a module-level constant,
translated where it is printed; :func:`L_` marks a table label, translated where the table is shown, in its own
gettext context :data:`TABLE_LABEL`); the catalog is the standard gettext pair
``minivllm/locale/zh_CN/LC_MESSAGES/minivllm.po`` (edited by translators) and ``minivllm.mo`` (compiled from it by
``python -m minivllm.course.i18n_catalog compile``; a test checks it is up to date). Only the standard library's
``gettext`` runs here, so the engine stays free of course dependencies; the engine marks only the errors that
the notebooks provoke on purpose (vLLM's own errors are English only: minivllm keeps English the default).

A message is looked up when it is used, not when a module is imported, so switching the language later changes
every message printed after the switch.
"""

from __future__ import annotations

import gettext as _gettext
import unicodedata
from pathlib import Path
from typing import Optional

DOMAIN = "minivllm"
LOCALE_DIR = Path(__file__).resolve().parent / "locale"
LANGUAGES = ("en", "zh_CN")
ENV_VAR = "MINIVLLM_LANG"
# The gettext context (msgctxt) of the labels marked with L_: a column called "prompt tokens" is not the fragment
# "prompt tokens" of a sentence, so the two are translated apart.
TABLE_LABEL = "table label"

_ALIASES = {"en": "en", "en_US": "en", "en_GB": "en", "C": "en",
            "zh": "zh_CN", "zh_CN": "zh_CN", "zh-CN": "zh_CN", "zh_Hans": "zh_CN", "zh-Hans": "zh_CN"}

_language = "en"
_translation: _gettext.NullTranslations = _gettext.NullTranslations()


def _normalise(language: str) -> str:
    key = language.split(".")[0]  # "zh_CN.UTF-8" -> "zh_CN"
    if key not in _ALIASES:
        raise ValueError(f"language must be one of {', '.join(LANGUAGES)} (or an alias such as 'zh'), got {language!r}")
    return _ALIASES[key]


def set_language(language: str) -> str:
    """Switch every translated message to ``language`` (``"en"`` or ``"zh_CN"``; ``"zh"``/``"zh-CN"`` accepted).

    Returns the normalised language. Raises ``ValueError`` naming the languages for any other value, and
    ``FileNotFoundError`` if the compiled catalog is missing (a broken install); in both cases nothing changes.
    """
    global _language, _translation
    lang = _normalise(language)
    if lang == "en":
        translation: _gettext.NullTranslations = _gettext.NullTranslations()
    else:
        mo = LOCALE_DIR / lang / "LC_MESSAGES" / f"{DOMAIN}.mo"
        if not mo.is_file():
            raise FileNotFoundError(f"no compiled catalog for {lang}: {mo}")
        with open(mo, "rb") as f:
            translation = _gettext.GNUTranslations(f)
    _language, _translation = lang, translation
    return lang


def get_language() -> str:
    """The language messages are formatted in now: ``"en"`` or ``"zh_CN"``."""
    return _language


def is_chinese() -> bool:
    return _language == "zh_CN"


def _(message: str) -> str:
    """``message`` (English, the msgid) in the current language; English when the catalog lacks it."""
    return _translation.gettext(message)


def ngettext(singular: str, plural: str, n: int) -> str:
    """The form of ``singular``/``plural`` for ``n`` in the current language."""
    return _translation.ngettext(singular, plural, n)


def N_(message: str) -> str:
    """Mark ``message`` for the catalog without translating it: returns it unchanged.

    For English text kept in a module-level constant (a table of hints, a list of known mistakes): the
    constant is built at import, before any :func:`set_language`, so it stays English and the code that prints
    it calls ``_(CONST)`` then. ``python -m minivllm.course.i18n_catalog update`` extracts ``N_("...")`` as it
    extracts ``_("...")``.
    """
    return message


def pgettext(context: str, message: str) -> str:
    """``message`` in the current language as it is translated in ``context`` (gettext's ``msgctxt``); English
    when the catalog has no such entry."""
    return _translation.pgettext(context, message)


def L_(label: str) -> str:
    """Mark ``label``, a row or column label of a table a notebook builds, for the catalog (context
    :data:`TABLE_LABEL`) without translating it: returns it unchanged, so that code keeps indexing the table by its
    English label. :func:`minivllm.course.tables.translated_labels` translates the labels of the copy it shows.
    ``python -m minivllm.course.i18n_catalog update`` extracts ``L_("...")`` with that context.
    """
    return label


def text_width(text: str) -> int:
    """Columns ``text`` takes in a terminal or a notebook's monospaced output: 2 for each wide character (Chinese),
    1 for the others (``unicodedata.east_asian_width``)."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def ljust(text: str, width: int) -> str:
    """``text`` padded with spaces to ``width`` columns (``str.ljust`` counting a Chinese character as two), so
    that a table with translated headers or cells stays aligned; English text is padded exactly as by ``ljust``."""
    return text + " " * max(0, width - text_width(text))


def rjust(text: str, width: int) -> str:
    """``text`` right-aligned in ``width`` columns, as :func:`ljust` counts them."""
    return " " * max(0, width - text_width(text)) + text


def _from_environment() -> Optional[str]:
    from minivllm import envs

    value = envs.MINIVLLM_LANG
    if value:
        return set_language(value)
    return None


_from_environment()

"""The font of the pictures in the current language: matplotlib's default for English, a CJK fallback for Chinese.

matplotlib's default font (DejaVu Sans) has no Chinese glyphs: a Chinese label would be drawn as empty boxes (and a
"Glyph ... missing" warning). Under ``set_language("zh_CN")`` every drawing function of the course calls
:func:`use_language_font` first; it registers Noto Sans CJK SC, shipped by the PyPI package ``mplfonts`` (installed
with ``--no-deps``: only its font files are used), and appends it to ``rcParams["font.family"]``. matplotlib (>= 3.6)
falls back glyph by glyph along ``font.family``, so Latin letters, digits and code names stay in DejaVu Sans and only
the Chinese characters come from Noto. (A name appended to ``rcParams["font.sans-serif"]`` instead is used only when
every font before it is missing, never for a missing glyph.)

In English nothing is changed: the English figures are drawn with exactly today's fonts.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from minivllm.i18n import is_chinese

PACKAGE = "mplfonts"
FONT_FILE = "NotoSansCJKsc-Regular.otf"
FONT_NAME = "Noto Sans CJK SC"


def cjk_font_path() -> Path:
    """The path of ``mplfonts``' Noto Sans CJK SC font file.

    Found through the package's import spec without importing it (``import mplfonts`` needs its own dependencies,
    ``fire`` and ``fontmeta``, which the course does not install).

    Raises:
        ModuleNotFoundError: ``mplfonts`` is not installed (naming the command that installs it).
        FileNotFoundError: the installed ``mplfonts`` lacks the font file.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the Chinese figures need the font package {PACKAGE!r} (Noto Sans CJK SC, about 85 MB): "
            f"pip install --no-deps {PACKAGE} (it is in requirements.txt)", name=PACKAGE)
    path = Path(list(spec.submodule_search_locations)[0]) / "fonts" / FONT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{PACKAGE} is installed but has no {FONT_FILE}: {path}")
    return path


class _NoBoldWarning(logging.Filter):
    """Drops matplotlib's "findfont: Failed to find font weight bold for Noto Sans CJK SC" lines: ``mplfonts``
    ships the regular weight only, so bold Chinese labels are drawn regular, as that line says, once per label."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (FONT_NAME in record.getMessage() and "weight" in record.getMessage())


_NO_BOLD_WARNING = _NoBoldWarning()


def use_language_font(*axes: Any) -> None:
    """Make matplotlib able to draw the current language's labels; call it before drawing.

    English: does nothing. Chinese: registers Noto Sans CJK SC once and appends it to ``rcParams["font.family"]``
    (idempotent). Raises as :func:`cjk_font_path` when ``mplfonts`` is missing, only in Chinese.

    ``axes``: axes made before this call (a notebook's ``plt.subplots`` passed in as ``ax=``). An axes' title and
    axis labels are text objects made with the axes, which keep the font list of that moment: ``set_title`` and
    ``set_xlabel`` change their text only, so a Chinese label on an axes made before the font was added would draw
    as empty boxes. They get the font list too.
    """
    if not is_chinese():
        return
    import matplotlib
    from matplotlib import font_manager

    if FONT_NAME not in {f.name for f in font_manager.fontManager.ttflist}:
        font_manager.fontManager.addfont(str(cjk_font_path()))
        logging.getLogger("matplotlib.font_manager").addFilter(_NO_BOLD_WARNING)
    family = list(matplotlib.rcParams["font.family"])
    if FONT_NAME not in family:
        matplotlib.rcParams["font.family"] = family + [FONT_NAME]
    for ax in axes:
        # set_title(loc="left"/"right") writes into the axes' two side titles (matplotlib keeps them as
        # _left_title and _right_title beside the public `title`).
        titles = [ax.title] + [t for t in (getattr(ax, "_left_title", None), getattr(ax, "_right_title", None)) if t]
        for text in titles + [ax.xaxis.label, ax.yaxis.label]:
            if FONT_NAME not in text.get_fontfamily():
                text.set_fontfamily(list(text.get_fontfamily()) + [FONT_NAME])


def monospace() -> Any:
    """The font family for a monospaced label that may hold the current language's words (a hash beside 哈希):
    ``"monospace"``, with Noto Sans CJK SC after it in Chinese (an explicit family replaces ``rcParams["font.family"]``,
    so the Chinese characters of a monospaced label would otherwise draw as empty boxes). Call
    :func:`use_language_font` first (it registers the font)."""
    return ["monospace", FONT_NAME] if is_chinese() else "monospace"


@functools.lru_cache(maxsize=None)
def fontconfig_file() -> Path:
    """A fontconfig configuration (``fonts.conf``) that adds Noto Sans CJK SC to the system's fonts, for Graphviz.

    Graphviz's ``dot`` (``minivllm.course.diagrams``) finds fonts through fontconfig, not through matplotlib, and a
    Debian image has no Chinese font: run with ``FONTCONFIG_FILE`` set to this file, a label in the family
    ``"DejaVu Sans,Noto Sans CJK SC"`` draws its Latin letters in DejaVu Sans and its Chinese characters in Noto.
    The file includes the system's ``/etc/fonts/fonts.conf`` and adds a folder holding only a link to
    ``mplfonts``' font file (the package's folder has other CJK fonts, which fontconfig could otherwise pick), with
    fontconfig's cache in the same temporary folder (made once per process and removed when it exits; the user's
    cache is left alone).

    Raises as :func:`cjk_font_path` when ``mplfonts`` is missing.
    """
    font = cjk_font_path()
    root = Path(tempfile.mkdtemp(prefix="minivllm-fontconfig-"))
    atexit.register(shutil.rmtree, root, True)  # ignore_errors: the folder is ours alone, gone or not
    (root / "fonts").mkdir()
    (root / "fonts" / FONT_FILE).symlink_to(font)
    conf = root / "fonts.conf"
    conf.write_text(
        '<?xml version="1.0"?>\n<!DOCTYPE fontconfig SYSTEM "fonts.dtd">\n<fontconfig>\n'
        '  <include ignore_missing="yes">/etc/fonts/fonts.conf</include>\n'
        f"  <dir>{root / 'fonts'}</dir>\n  <cachedir>{root / 'cache'}</cachedir>\n</fontconfig>\n",
        encoding="utf-8")
    return conf


__all__ = ["FONT_NAME", "cjk_font_path", "fontconfig_file", "monospace", "use_language_font"]

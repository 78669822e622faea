"""The API reference: docs/build_api.py renders the public modules' docstrings with pdoc,
without a warning, every public name gets its section and every link inside it lands."""

from __future__ import annotations

import inspect
import os
import posixpath
import re
import subprocess
import sys
import textwrap
from html.parser import HTMLParser
from pathlib import Path

import pytest

import gemmconv

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("pdoc", reason="the docs extra (pip install -e '.[docs]')")


class _Page(HTMLParser):
    """The element ids of one page and the targets of its links."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if attributes.get("id"):
            self.ids.add(attributes["id"])
        if tag == "a" and attributes.get("href"):
            self.hrefs.append(attributes["href"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("api")
    # The command the README gives, in a fresh process: pdoc imports the package itself.
    result = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "build_api.py"), str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        timeout=300,
    )
    # The script exits 1 on any warning pdoc raises (a docstring or annotation it could
    # not read, a page it did not write) and prints them.
    assert result.returncode == 0 and not result.stderr, result.stderr
    return out


def _pages(reference: Path) -> dict[str, _Page]:
    pages = {}
    for path in reference.rglob("*.html"):
        page = _Page()
        page.feed(path.read_text(encoding="utf-8"))
        pages[path.relative_to(reference).as_posix()] = page
    return pages


def test_every_public_name_has_its_section(reference):
    pages = _pages(reference)
    # Every name gemmconv exports, but its modules (which have pages of their own).
    top = [n for n in gemmconv.__all__ if not inspect.ismodule(getattr(gemmconv, n))]
    assert {"conv2d", "explain", "convert", "revert", "sync_choices", "verify", "SOLVERS"} <= set(
        top
    )
    assert set(top) <= pages["gemmconv.html"].ids
    assert {"conv1d", "conv2d", "conv3d", "explain"} <= pages["gemmconv/functional.html"].ids
    assert {"convert", "revert", "ConversionReport"} <= pages["gemmconv/convert.html"].ids
    # The modules' own method and constructor keyword live in a private base; the
    # reference documents them on each class.
    for cls in gemmconv.nn.__all__:
        assert {cls, f"{cls}.solvers", f"{cls}.__init__"} <= pages["gemmconv/nn.html"].ids
    nn_page = (reference / "gemmconv" / "nn.html").read_text(encoding="utf-8")
    assert "_GemmConvMixin</a>" not in nn_page


def test_every_link_inside_the_reference_lands(reference):
    pages = _pages(reference)
    dead = []
    for name, page in pages.items():
        for href in page.hrefs:
            if re.match(r"[a-z]+:", href):  # another site: pytorch.org, wikipedia
                continue
            path, _, anchor = href.partition("#")
            target = posixpath.normpath(posixpath.join(posixpath.dirname(name), path))
            target = target if path else name
            if target not in pages or (anchor and anchor not in pages[target].ids):
                dead.append(f"{name}: {href}")
    assert not dead, dead


def test_the_module_docstrings_quote_torch_at_its_own_indentation():
    # pdoc reads lines indented past the first paragraph's as a code block: torch's
    # documentation, quoted after gemmconv's unindented lines, must be dedented.
    for cls in gemmconv.nn.__all__:
        quoted = getattr(gemmconv.nn, cls).__doc__.split("torch's documentation:", 1)[1]
        assert textwrap.dedent(quoted) == quoted, cls

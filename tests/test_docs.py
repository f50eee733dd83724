"""The documentation stays true: docs/configuration.md is exactly what deploy/config_doc.py makes of
the serving config, every link in README.md and docs/*.md reaches a file (and heading) inside this
repository, and the tests the README's fast subset leaves out by name still exist."""

import difflib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
COMMENT = re.compile(r"<!--.*?-->", re.S)
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$", re.M)
AUTOLINK = re.compile(r"<([A-Za-z][A-Za-z0-9+.-]*:[^>\s]*)>")
BARE_URL = re.compile(r"(?<![\w/<])(?:https?|ftp)://[^\s)>\]]+|(?<![\w/<.])www\.[^\s)>\]]+")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.*?)[ \t]*#*[ \t]*$", re.M)


def test_configuration_doc_is_generated_from_the_serving_config():
    from deploy.config_doc import DOC, REGENERATE, render

    want = render()
    have = DOC.read_text() if DOC.exists() else ""
    if have != want:
        diff = "".join(difflib.unified_diff(have.splitlines(True), want.splitlines(True),
                                            "docs/configuration.md", "generated from deploy/config.py", n=1))
        pytest.fail(f"docs/configuration.md differs from the serving config (deploy/config.py, ServeConfig); "
                    f"regenerate it with `{REGENERATE}` and commit the result:\n{diff[:4000]}")


def _prose(text: str) -> str:
    """The text a reader sees as prose: code blocks, code spans and HTML comments removed."""
    return CODE_SPAN.sub("", FENCE.sub("", COMMENT.sub("", text)))


def _links(text: str) -> list[str]:
    prose = _prose(text)
    return INLINE_LINK.findall(prose) + REFERENCE.findall(prose) + AUTOLINK.findall(prose) + BARE_URL.findall(prose)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: links and code marks reduced to their text, lower case,
    punctuation but ``-`` and ``_`` dropped, spaces as ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return "".join(c for c in text.lower() if c.isalnum() or c in "-_ ").replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _problem(page: Path, target: str) -> str | None:
    """Why ``target`` (a link on ``page``) is not a link to something in this repository, or None."""
    if SCHEME.match(target) or target.startswith(("//", "www.")):
        return "leaves the repository (links stay relative, to files in it)"
    path, _, anchor = target.partition("#")
    if path.startswith("/"):
        return "is an absolute path (links are relative to the page)"
    dest = (page.parent / path).resolve() if path else page
    if not dest.is_relative_to(ROOT):
        return "points outside the repository"
    if not dest.exists():
        return "points to no file"
    if anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
        return f"names no heading of {dest.relative_to(ROOT)}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_stays_inside_the_repository_and_reaches_a_file(page):
    bad = [f"{target!r} {why}" for target in _links(page.read_text()) if (why := _problem(page, target))]
    assert not bad, f"{page.relative_to(ROOT)}: " + "; ".join(bad)


def test_the_link_check_sees_links_and_ignores_code():
    text = ("See [the guide](docs/x.md#a-b), ![img](a.png \"t\"), <https://example.com>, www.example.org and\n"
            "[ref]: ../elsewhere.md\n```bash\ncurl [x](http://127.0.0.1:8000)\n```\n`[y](http://no)`\n")
    assert sorted(_links(text)) == sorted(["docs/x.md#a-b", "a.png", "https://example.com", "www.example.org",
                                           "../elsewhere.md"])
    assert _problem(ROOT / "README.md", "../shared/docs/ARCHITECTURE.md") == "points outside the repository"
    assert "leaves the repository" in _problem(ROOT / "README.md", "https://example.com")
    assert _slug("Scaling: experts and `attention`") == "scaling-experts-and-attention"


def test_the_fast_subset_leaves_out_the_tests_marked_where_they_stand():
    """README's `-m "not cluster"` leaves out the tests that say their tier themselves (``operator``,
    ``cluster``) and those of the session's Ray cluster (its fixtures), and keeps the rest."""
    files = ["tests/actors/test_dispatch.py", "tests/test_readme.py", "tests/cluster/test_topology.py"]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", "-m",
                          "not cluster", *files], cwd=ROOT, capture_output=True, text=True, timeout=120).stdout
    for gone in ("test_gloo_exchange_equals_local_dispatch", "test_readme_quick_start_serves_and_stops",
                 "test_local_cluster_starts_distinct_nodes_and_stops_them_all"):  # operator
        assert gone not in out, out
    for kept in ("tests/actors/test_dispatch.py::", "tests/test_readme.py::"):
        assert kept in out, out

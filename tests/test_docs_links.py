"""Every relative link and anchor in README.md and docs/*.md resolves (files exist, #anchors name a heading)."""
import glob
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"(`+).*?\1")


def _prose(path: str) -> list[str]:
    """The file's lines outside fenced code blocks, with inline code spans blanked."""
    lines, fenced = [], False
    for line in open(path, encoding="utf-8"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(CODE_SPAN.sub("x", line))
    return lines


def anchors(path: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, duplicates numbered."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in open(path, encoding="utf-8"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(doc: str) -> list[str]:
    return [m.group(1) for line in _prose(os.path.join(REPO, doc)) for m in LINK.finditer(line)]


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve(doc):
    base = os.path.dirname(os.path.join(REPO, doc))
    bad = []
    for target in links(doc):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):       # http:, https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(base, path)) if path else os.path.join(REPO, doc)
        if not os.path.exists(full):
            bad.append(f"{target}: no {os.path.relpath(full, REPO)}")
        elif anchor and (not full.endswith(".md") or anchor not in anchors(full)):
            bad.append(f"{target}: no heading #{anchor} in {os.path.relpath(full, REPO)}")
    assert not bad, f"{doc}: " + "; ".join(bad)


def test_readme_links_every_docs_page():
    linked = {os.path.normpath(t.partition("#")[0]) for t in links("README.md")}
    assert "docs/pipeline.md" in DOCS
    assert [d for d in DOCS[1:] if d not in linked] == []

"""The documentation holds together: README.md, BENCHMARKS.md and docs/*.md.

Every relative link names a file that exists, every ``#anchor`` names a heading of its
target (GitHub's anchors: lowercase, spaces to '-', punctuation but '-' and '_' dropped,
a repeated heading numbered), the README stays a front page, and every page under docs/
is reachable from the README or the docs index. Plain text only: no jax.
"""

import collections
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
README_MAX_LINES = 250

FENCE = re.compile(r"^ {0,3}(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def pages() -> list[str]:
    docs = sorted(os.path.join("docs", n) for n in os.listdir(DOCS) if n.endswith(".md"))
    return ["README.md", "BENCHMARKS.md", *docs]


def prose_lines(path: str) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks."""
    out, fence = [], None
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            m = FENCE.match(line)
            if m:
                if fence is None:
                    fence = m.group(1)
                elif m.group(1) == fence:
                    fence = None
                continue
            if fence is None:
                out.append((number, line.rstrip("\n")))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(path: str) -> set[str]:
    seen: collections.Counter = collections.Counter()
    out = set()
    for _, line in prose_lines(path):
        m = HEADING.match(line)
        if m:
            base = slug(m.group(2))
            out.add(f"{base}-{seen[base]}" if seen[base] else base)
            seen[base] += 1
    return out


def links(path: str) -> list[tuple[int, str]]:
    """(line number, target) of every link outside code."""
    out = []
    for number, line in prose_lines(path):
        for m in LINK.finditer(CODE_SPAN.sub(lambda c: "x" * len(c.group(0)), line)):
            out.append((number, line[m.start(1):m.end(1)]))
    return out


def relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I)  # http:, https:, mailto:


def test_slug_follows_githubs_rules():
    assert slug("Compiling for GPUs you don't have") == "compiling-for-gpus-you-dont-have"
    assert slug("All-to-all (`model.cp_impl=all_to_all`)") == "all-to-all-modelcp_implall_to_all"
    assert slug("llama3_8b on 8 H100s (one node), batch 16 x 8192 — cold run 255 s") == (
        "llama3_8b-on-8-h100s-one-node-batch-16-x-8192--cold-run-255-s")
    assert slug("1+3. Train step") == "13-train-step"


def test_links_are_found_outside_code_only():
    assert [t for _, t in links("docs/README.md")], "the docs index links nowhere?"
    for path in pages():
        for _, target in links(path):
            assert " " not in target and not target.startswith("`"), (path, target)


@pytest.mark.parametrize("path", pages())
def test_every_relative_link_and_anchor_resolves(path):
    base = os.path.dirname(os.path.join(ROOT, path))
    broken = []
    for number, target in links(path):
        if not relative(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(base, file_part)) if file_part else \
            os.path.join(ROOT, path)
        if not os.path.exists(dest):
            broken.append(f"{path}:{number}: {target}: no such file")
            continue
        if anchor and dest.endswith(".md"):
            if anchor not in anchors(os.path.relpath(dest, ROOT)):
                broken.append(f"{path}:{number}: {target}: no such heading")
    assert broken == []


def test_readme_is_a_front_page():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        n = len(f.readlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move detail into docs/"


def test_every_docs_page_is_linked_from_the_readme_or_the_index():
    linked = set()
    for path in ("README.md", "docs/README.md"):
        base = os.path.dirname(os.path.join(ROOT, path))
        for _, target in links(path):
            if relative(target) and target.partition("#")[0]:
                linked.add(os.path.normpath(os.path.join(base, target.partition("#")[0])))
    unlinked = [p for p in pages()[2:] if p != os.path.join("docs", "README.md")
                and os.path.join(ROOT, p) not in linked]
    assert unlinked == []
    assert os.path.join(DOCS, "README.md") in linked, "README.md does not link the docs index"

"""The documentation's links: every relative link between README, docs/, ARCHITECTURE,
CHANGELOG and RESULTS names a file that exists and, with ``#``, a heading it has.

The pages are read as Markdown where they live (GitHub, PyPI, a clone); this check is their
build step: a page moved or a heading renamed fails here, not in a reader's browser.
"""
from __future__ import annotations

import glob
import os.path as osp
import re
from functools import cache
from typing import Any

REPO_ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))

LINK = re.compile(r'(?<!!)\[[^\]]*\]\(([^)\s]+)\)')
FENCE = re.compile(r'^(```|~~~)')


def pages() -> list[str]:
    found = [osp.join(REPO_ROOT, name) for name in
             ('README.md', 'ARCHITECTURE.md', 'CHANGELOG.md', 'benchmarks/RESULTS.md')]
    return found + sorted(glob.glob(osp.join(REPO_ROOT, 'docs', '*.md')))


def prose(path: str) -> list[str]:
    """The page's lines outside fenced code blocks."""
    lines, fenced = [], False
    with open(path, encoding='utf-8') as f:
        for line in f:
            if FENCE.match(line.strip()):
                fenced = not fenced
            elif not fenced:
                lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r'[^\w\- ]', '', heading.strip().lower()).replace(' ', '-')


@cache
def anchors(path: str) -> frozenset[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in prose(path):
        match = re.match(r'^#{1,6} (.+)$', line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f'{base}-{count}')
    return frozenset(found)


def broken_links(path: str) -> list[str]:
    broken = []
    for line in prose(path):
        for target in LINK.findall(line):
            if re.match(r'^[a-z]+:', target):  # https:, mailto:
                continue
            file, _, anchor = target.partition('#')
            resolved = osp.normpath(osp.join(osp.dirname(path), file)) if file else path
            if not osp.exists(resolved):
                broken.append(f'{osp.relpath(path, REPO_ROOT)}: {target} (no such file)')
            elif anchor and resolved.endswith('.md') and anchor not in anchors(resolved):
                broken.append(f'{osp.relpath(path, REPO_ROOT)}: {target} (no such heading)')
    return broken


def test_every_relative_link_and_anchor_resolves() -> None:
    broken = [link for page in pages() for link in broken_links(page)]
    assert not broken, '\n'.join(broken)


def test_the_docs_pages_are_all_reached_from_readme() -> None:
    with open(osp.join(REPO_ROOT, 'README.md'), encoding='utf-8') as f:
        readme = f.read()
    missing = [osp.basename(p) for p in glob.glob(osp.join(REPO_ROOT, 'docs', '*.md'))
               if f'docs/{osp.basename(p)}' not in readme]
    assert not missing, f'docs pages README does not link: {missing}'


def test_readme_fits_on_a_few_screens() -> None:
    with open(osp.join(REPO_ROOT, 'README.md'), encoding='utf-8') as f:
        assert len(f.readlines()) <= 250, 'README.md: move detail into docs/'


def test_the_link_check_finds_a_broken_link_and_a_missing_heading(tmp_path: Any) -> None:
    page = tmp_path / 'page.md'
    page.write_text('# Title\n\n[ok](#title) [gone](nowhere.md) [no](#other)\n'
                    '```\n[in code](ignored.md)\n```\n', encoding='utf-8')
    assert [b.split(': ', 1)[1] for b in broken_links(str(page))] == [
        'nowhere.md (no such file)', '#other (no such heading)']

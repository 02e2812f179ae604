"""The docs site: `mkdocs build --strict` over docs/ (mkdocs.yml), so a broken link,
a missing anchor or a bad config fails here, and every page of docs/ is in its nav."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


class _Loader(yaml.SafeLoader):
    """mkdocs.yml as plain data: its `!!python/name:` tags (a fence's formatter) as
    their names, not imported."""


_Loader.add_multi_constructor("tag:yaml.org,2002:python/",
                              lambda loader, suffix, node: suffix)


def nav_pages(nav) -> list[str]:
    """The Markdown files a nav lists, at any depth."""
    if isinstance(nav, str):
        return [nav] if nav.endswith(".md") else []
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in nav_pages(value)]
    if isinstance(nav, list):
        return [page for item in nav for page in nav_pages(item)]
    return []


def test_the_site_builds_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    assert (tmp_path / "index.html").is_file()
    for page in DOCS.glob("*.md"):
        if page.name != "index.md":
            assert (tmp_path / page.stem / "index.html").is_file(), page.name


def test_every_page_is_in_the_nav():
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_Loader)
    assert config["docs_dir"] == "docs"
    listed = nav_pages(config["nav"])
    assert len(listed) == len(set(listed)), listed
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(listed) == pages

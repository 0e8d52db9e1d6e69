"""The code blocks of the README and of every page under docs/ run as written.

The blocks of one page run in order in one fresh folder (a bash block may write the model folder
the next Python block loads), with this environment's ``python`` and ``arctic-rl`` first on PATH.
A block preceded by ``<!-- doc-test: skip REASON -->`` is not run (a GPU-only command, or one a
test of its own runs, such as the demo); the reason is required. ``toml`` and ``yaml`` blocks are
parsed, and a ``yaml`` block marked ``<!-- doc-test: arctic-config -->`` must be a valid config.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"(?:<!-- doc-test: (?P<directive>[^>]*?) -->\s*\n)?^```(?P<lang>[\w-]*)\n(?P<code>.*?)^```",
                   re.S | re.M)
RUNNERS = {"python": [sys.executable, "-"], "bash": ["bash", "-euo", "pipefail", "-s"]}


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    code: str
    directive: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line} ({self.lang})"


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    return [Block(page, text.count("\n", 0, m.start("code")), m["lang"], m["code"], (m["directive"] or "").strip())
            for m in BLOCK.finditer(text)]


def run_block(block: Block, cwd: Path) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(RUNNERS[block.lang], input=block.code, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"{block} failed:\n{block.code}\n--- stderr ---\n{proc.stderr[-4000:]}"


def check_block(block: Block, cwd: Path) -> None:
    if block.directive.startswith("skip"):
        assert block.directive.removeprefix("skip").strip(), f"{block}: a skipped block must say why"
    elif block.lang in RUNNERS:
        run_block(block, cwd)
    elif block.lang == "toml":
        tomllib.loads(block.code)
    elif block.lang == "yaml":
        data = yaml.safe_load(block.code)
        if block.directive == "arctic-config":
            from arctic_core.config import ArcticConfig

            ArcticConfig.from_dict(data)


def test_every_page_is_found_and_has_its_blocks_parsed():
    assert ROOT / "README.md" in PAGES
    readme = blocks(ROOT / "README.md")
    assert any(b.lang == "python" and not b.directive for b in readme), "the README's client example must run"
    for page in PAGES:
        for block in blocks(page):
            assert block.lang, f"{block}: name the block's language"


def test_the_configuration_reference_is_the_generated_one():
    from arctic_core.config_docs import BUILTIN_PLUGINS, config_reference
    from arctic_core.plugins.registry import default_registry

    page = ROOT / "docs" / "guides" / "configuration.md"
    assert page.read_text() == config_reference(default_registry(), BUILTIN_PLUGINS), (
        "the config changed: regenerate with `arctic-rl config-reference --builtin > docs/guides/configuration.md`")


DEVELOPMENT_TALK = re.compile(r"\bissue #?\d|\bsessions?\b|device (call|time)|carried|\.\./shared|\bPR #?\d", re.I)


def test_pages_speak_to_users_not_of_the_projects_development():
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            assert not DEVELOPMENT_TALK.search(line), f"{page.relative_to(ROOT)}:{number}: {line}"


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)], ids=lambda p: str(p.relative_to(ROOT)))
def test_the_code_blocks_run_as_written(page, tmp_path):
    for block in blocks(page):
        check_block(block, tmp_path)

"""The deployment files under deploy/, read as the tools that consume them read them:
YAML documents, the shell commands inside them, and the `pdserve` and `ray start`
command lines in those commands."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import yaml

from tests.commands import markdown_shell_blocks, pdserve_commands, shell_words

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
LAUNCHERS = sorted((DEPLOY / "ray").glob("*.yaml"))
KUBERAY = DEPLOY / "kuberay"
DASHBOARD = DEPLOY / "observability" / "pdserve-dashboard.json"


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def strings(node) -> list[str]:
    """Every string value in a loaded YAML / JSON document."""
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [s for value in node.values() for s in strings(value)]
    if isinstance(node, list):
        return [s for value in node for s in strings(value)]
    return []


def readme_shell(path: Path) -> str:
    """The shell blocks of a Markdown file."""
    return "\n".join(text for _, text in markdown_shell_blocks(path.read_text()))


def dockerfile_shell(path: Path) -> str:
    """RUN / CMD / ENTRYPOINT of a Dockerfile as shell (exec form joined), comments out."""
    lines = [line for line in path.read_text().replace("\\\n", " ").splitlines()
             if not line.lstrip().startswith("#")]
    shell = []
    for line in lines:
        instruction, _, rest = line.strip().partition(" ")
        if instruction.upper() in ("RUN", "CMD", "ENTRYPOINT"):
            rest = rest.strip()
            shell.append(shlex.join(json.loads(rest)) if rest.startswith("[") else rest)
    return "\n".join(shell)


def ray_start(command: str) -> dict | None:
    """The options of the `ray start` in a shell command, parsed by Ray's own CLI (a
    bad option raises click's error); None without one."""
    from ray.scripts.scripts import start

    match = re.search(r"\bray start\s(.*)", command)
    if match is None:
        return None
    return start.make_context("start", shell_words(match.group(1))).params


def deploy_files() -> list[Path]:
    """Every file under deploy/ that may hold a pdserve command, and the Dockerfile."""
    return sorted(p for p in DEPLOY.rglob("*")
                  if p.suffix in (".yaml", ".yml", ".md") or p.name == "Dockerfile")


def commands_in(path: Path) -> list[list[str]]:
    """The pdserve commands of one deployment file, read the way its tool reads it."""
    if path.name == "Dockerfile":
        return pdserve_commands(dockerfile_shell(path))
    if path.suffix == ".md":
        return pdserve_commands(readme_shell(path))
    return [words for doc in documents(path) for text in strings(doc)
            for words in pdserve_commands(text)]


def serve_command(commands: list[list[str]]) -> list[str]:
    """The one `pdserve serve` among a file's commands."""
    serves = [words for words in commands if words[:1] == ["serve"]]
    assert len(serves) == 1, serves
    return serves[0]

"""Every `pdserve` command line in the shell blocks of README.md and docs/*.md parsed by
pdserve's own parser (`serve` also makes its settings), as the deployment files' lines
are (tests/deploy/test_commands.py): a renamed or misspelt flag in the docs fails here.

A `...` word is the docs' elision ("and the flags you need") and is dropped."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.commands import markdown_shell_blocks, parse, pdserve_command_lines

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def doc_commands() -> list[tuple[str, list[str]]]:
    """("file:line", arguments) of every pdserve command in the pages' shell blocks."""
    found = []
    for page in PAGES:
        for first, text in markdown_shell_blocks(page.read_text()):
            for line, argv in pdserve_command_lines(text):
                found.append((f"{page.relative_to(ROOT)}:{first + line - 1}",
                              [word for word in argv if word != "..."]))
    return found


COMMANDS = doc_commands()


def test_the_docs_have_commands_to_check():
    """The extraction itself: commands that went unseen would pass vacuously."""
    assert len(COMMANDS) > 5, COMMANDS
    assert "README.md" in {where.split(":")[0] for where, _ in COMMANDS}
    assert "serve" in {argv[0] for _, argv in COMMANDS if argv}


@pytest.mark.parametrize("argv", [argv for _, argv in COMMANDS],
                         ids=[where for where, _ in COMMANDS])
def test_a_pdserve_command_in_the_docs_parses(argv):
    assert argv, "a bare `pdserve`"
    parse(argv)


@pytest.mark.parametrize("shell, expected", [
    ("$ pdserve demo --offline\n", [(1, ["demo", "--offline"])]),
    ("PDSERVE_API_KEY=k RAY_ADDRESS='a b' pdserve admin list\n", [(1, ["admin", "list"])]),
    ("python -m pdserve demo\npython3 -m pdserve make-tiny-model d\n",
     [(1, ["demo"]), (2, ["make-tiny-model", "d"])]),
    ("# setup\npdserve serve --model tiny \\\n    --http-port 8000 | tee log && pdserve admin list\n",
     [(2, ["serve", "--model", "tiny", "--http-port", "8000"]), (3, ["admin", "list"])]),
    ("echo pdserve serve  # prose: pdserve serve\nmake demo\n", []),
], ids=["prompt", "env-prefix", "python-m", "continued-and-piped", "not-a-command"])
def test_doc_lines_are_cut_where_the_shell_would_cut_them(shell, expected):
    assert pdserve_command_lines(shell) == expected


def test_shell_blocks_of_a_page():
    page = ("text `pdserve serve --bad`\n\n```bash\npdserve demo\n```\n\n"
            "```python\npdserve = 1\n```\n\n- item\n\n    ```\n    pdserve admin list\n    ```\n"
            "\n````sh\n```\npdserve sim\n````\n")
    assert [(first, pdserve_command_lines(text)) for first, text in markdown_shell_blocks(page)
            ] == [(4, [(1, ["demo"])]), (14, [(1, ["admin", "list"])]),
                  (18, [(2, ["sim"])])]


def test_a_misspelt_flag_in_the_docs_is_refused():
    ((_, argv),) = pdserve_command_lines("pdserve serve --model tiny --prefil-workers 1\n")
    with pytest.raises(SystemExit) as refused:
        parse(argv)
    assert "unrecognized arguments" in str(refused.value.code)

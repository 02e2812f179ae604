"""`pdserve` command lines where files write them (shell in the deployment files, the
shell blocks of Markdown pages), cut where the shell would cut them and parsed by
pdserve's own parser. Used by tests/deploy and tests/docs."""
from __future__ import annotations

import contextlib
import io
import re
import shlex

from pdserve.cli import build_parser
from tests.deploy.capacity import serve_settings

# `pdserve` where a shell command starts: at the start of a line (after a `$ ` prompt),
# after a control operator, or after a command that runs the rest (exec, nohup, ...);
# after variable assignments (`FOO=1 pdserve ...`), and as `python -m pdserve`. Prose
# and comments that name pdserve are not commands.
_COMMAND = re.compile(
    r"(?:^(?:[ \t]*\$(?=\s))?|[;&|(]|\b(?:exec|nohup|then|do|time|setsid|env)\s)\s*"
    r"(?:[A-Za-z_]\w*=(?:\"[^\"]*\"|'[^']*'|[^\s'\"])*\s+)*"
    r"(?:python3?\s+-m\s+)?pdserve\s",
    re.MULTILINE)
OPERATORS = {";", "&", "&&", "|", "||", "(", ")", "<", ">", ">>", ">&", "<<", "2>", "&>"}
# The languages of a Markdown code block that hold shell ("" is a block without one).
SHELL_BLOCKS = ("", "sh", "bash", "shell", "console")


def shell_words(text: str) -> list[str]:
    """The words of a simple command: `text` up to its first control operator,
    redirection or comment, split as the shell splits them."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|()<>")
    lexer.whitespace_split = True
    words = []
    for word in lexer:
        if word in OPERATORS or word[0] in "#":
            break
        words.append(word)
    return words


def pdserve_command_lines(shell: str) -> list[tuple[int, list[str]]]:
    """(line, arguments) of every `pdserve ...` command in a piece of shell: the line
    (from 1) its `pdserve` is on, the arguments up to the first control operator or
    redirection, line continuations joined."""
    joined = shell.replace("\\\n", "  ")  # each offset kept: lines count in `shell`
    found = []
    for match in _COMMAND.finditer(joined):
        rest = joined[match.end():].split("\n", 1)[0]
        words = shell_words(rest)
        if words and words[-1].isdigit() and rest.rstrip().endswith(">&1"):
            words.pop()  # the 2 of 2>&1
        found.append((shell.count("\n", 0, match.end() - 1) + 1, words))
    return found


def pdserve_commands(shell: str) -> list[list[str]]:
    """The arguments of every `pdserve ...` command in a piece of shell."""
    return [words for _, words in pdserve_command_lines(shell)]


def markdown_shell_blocks(markdown: str,
                          languages: tuple[str, ...] = SHELL_BLOCKS) -> list[tuple[int, str]]:
    """(line, text) of every fenced code block of a Markdown page in one of `languages`:
    the line (from 1) of its first line of text, and its text (a list item's indent
    kept: the shell skips it)."""
    blocks = []
    fence = None  # the open block's fence, its language and first line
    lines: list[str] = []
    for number, line in enumerate(markdown.splitlines(), 1):
        if fence is None:
            opened = re.match(r"\s*(`{3,}|~{3,})\s*([^\s`{]*)", line)
            if opened:
                fence, language, first = opened.group(1), opened.group(2).lower(), number + 1
                lines = []
        elif re.fullmatch(rf"\s*{re.escape(fence[0])}{{{len(fence)},}}\s*", line):
            if language in languages:
                blocks.append((first, "\n".join(lines) + "\n"))
            fence = None
        else:
            lines.append(line)
    return blocks


def parse(argv: list[str]) -> None:
    """Parse as `pdserve` would; a bad command line raises SystemExit with what pdserve
    printed. `serve` also makes its settings. --help is a good command."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(printed):
        try:
            build_parser().parse_args(argv)
        except SystemExit as done:
            if done.code != 0 or "--help" not in argv:
                raise SystemExit(printed.getvalue() or done.code) from None
            return
    if argv[0] == "serve":
        serve_settings(argv)

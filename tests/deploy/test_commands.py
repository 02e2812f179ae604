"""Every `pdserve` command line in the deployment files (the launcher and KubeRay YAML,
the Dockerfile, the README's shell blocks) parsed by pdserve's own parser, and each
`serve` checked by the settings it makes: a renamed or misspelt flag fails here, not
on a GPU cluster."""
from __future__ import annotations

import pytest

from tests.commands import parse, pdserve_commands
from tests.deploy.files import DEPLOY, ROOT, commands_in, deploy_files


def test_the_files_that_run_pdserve_are_the_ones_expected():
    """The extraction itself: a file whose commands went unseen would pass vacuously."""
    found = {str(p.relative_to(DEPLOY)): [c[0] for c in commands]
             for p in deploy_files() if (commands := commands_in(p))}
    assert found == {"Dockerfile": ["--help"],
                     "README.md": ["admin", "admin", "bench"],
                     "kuberay/raycluster.yaml": ["serve"],
                     "kuberay/tensor-parallel/raycluster-tp4.yaml": ["serve"],
                     "ray/aws-tp4.yaml": ["serve"], "ray/aws.yaml": ["serve"],
                     "ray/local.yaml": ["serve"]}


@pytest.mark.parametrize("path", deploy_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_pdserve_command_in_a_deployment_file_parses(path):
    for argv in commands_in(path):
        parse(argv)


@pytest.mark.parametrize("shell, argv", [
    ('set -a && . ~/pdserve.env && nohup pdserve serve --model /m --prefill-resources '
     '\'{"prefill": 1}\' > ~/pdserve.log 2>&1 < /dev/null &',
     ["serve", "--model", "/m", "--prefill-resources", '{"prefill": 1}']),
    ("ulimit -n 65536\nexec pdserve serve --host 0.0.0.0 \\\n  --http-port 8000\nnext",
     ["serve", "--host", "0.0.0.0", "--http-port", "8000"]),
    ("pdserve admin list | jq . ; pdserve admin planner show",
     [["admin", "list"], ["admin", "planner", "show"]]),
    ("# the pdserve image: not a command\necho pdserve serve", []),
], ids=["backgrounded", "continued", "two", "prose"])
def test_commands_are_cut_where_the_shell_would_cut_them(shell, argv):
    expected = argv if not argv or isinstance(argv[0], list) else [argv]
    assert pdserve_commands(shell) == expected


@pytest.mark.parametrize("old, new, error", [
    ("--max-prefill-workers", "--max-prefil-workers", "unrecognized arguments"),
    ("--http-port 8000", "--http-port http", "invalid int value"),
    ("--min-decode-workers 1", "--min-decode-workers 6", "--min-decode-workers 6"),
    ("'{\"decode\": 1}'", "'{\"decode\": 0}'", "decode_resources must be"),
    ("--dtype bfloat16", "--dtype bf16", "invalid choice"),
], ids=["misspelt-flag", "bad-number", "bounds-out-of-order", "bad-resources",
        "bad-choice"])
def test_a_broken_serve_command_is_refused(old, new, error):
    shell = (DEPLOY / "ray" / "aws.yaml").read_text()
    assert old in shell
    (argv,) = pdserve_commands(shell.replace(old, new).split("- >-\n", 1)[1]
                               .replace("\n    ", " "))
    with pytest.raises(SystemExit) as refused:
        parse(argv)
    assert error in str(refused.value.code)

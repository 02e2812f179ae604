"""`pdserve admin` against servers that fail in the ways a network does: it tells a
router that cannot be reached from one that does not answer in time."""
from __future__ import annotations

import socket

from pdserve.cli import main


def test_a_router_that_does_not_answer_in_time_is_a_timeout_not_unreachable(capsys):
    with socket.socket() as listening:  # the kernel accepts; nothing ever answers
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        url = f"http://127.0.0.1:{listening.getsockname()[1]}"
        assert main(["admin", "--url", url, "--timeout", "0.3", "add", "decode"]) == 1
    err = capsys.readouterr().err
    assert f"{url} gave no answer within 0.3s" in err and "cannot reach" not in err


def test_a_router_that_is_not_there_cannot_be_reached(capsys):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"  # bound, not listening
        assert main(["admin", "--url", url, "--timeout", "5", "list"]) == 1
    assert f"cannot reach {url}" in capsys.readouterr().err

"""The Ray cluster a pdserve command starts for itself and the clusters it joins, run
as users run them: the README's commands as processes, over a real redis-server, each
in a HOME of its own (Ray keeps its token in ~/.ray/auth_token).

A cluster `pdserve serve` starts has Ray's token authentication on (Ray 2.60's default)
and is for this machine alone: nothing of it listens beyond loopback. `pdserve router`
joins it with the token it finds, or exits naming what is missing; `pdserve serve
--ray-address` and `pdserve router` join a cluster with token authentication and one
without."""
from __future__ import annotations

import ipaddress
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from pdserve.client import Client
from tests.engine.test_hf_oracle import Oracle
from tests.front_process import FrontProcess, Output

PROMPT = [9, 8, 7, 6, 5, 4]
MAX_TOKENS = 24
ENGINE = ("--max-model-len", "512", "--kv-cache-memory-bytes", str(32 << 20))


@pytest.fixture(scope="module")
def hf_greedy(llama_dir) -> list[int]:
    return Oracle(llama_dir).generate(PROMPT, MAX_TOKENS)[0]


def user(home: Path, marker: str = "", **env: str) -> dict[str, str]:
    """A user's environment: their HOME, no Ray setting but those given, and a marker
    every process started from it inherits."""
    home.mkdir(parents=True, exist_ok=True)
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")
                 and k != "RAY_ADDRESS"}
    return {**inherited, "HOME": str(home), "PDSERVE_TEST_MARKER": marker, **env}


@pytest.fixture(scope="module")
def serve(tmp_path_factory, llama_dir, redis):
    """The README's `pdserve serve --model M` with $PDSERVE_REDIS_URL: it starts its own
    Ray. Yields its environment, gRPC target and marker."""
    marker = uuid.uuid4().hex
    env = user(tmp_path_factory.mktemp("home"), marker, PDSERVE_REDIS_URL=redis.url)
    process = FrontProcess("serve", "--model", str(llama_dir), "--grpc-port", "0",
                           "--http-port", "0", *ENGINE, env=env)
    with process:
        target, _ = process.serving()
        yield env, target, marker
        assert process.terminate(timeout_s=60) == 0
    assert not process.tracebacks(), process.tracebacks()


def router(env: dict[str, str], *flags: str) -> FrontProcess:
    return FrontProcess("router", "--grpc-port", "0", "--http-port", "0", *flags, env=env)


def greedy(target: str) -> list[int]:
    with Client(target) as client:
        return client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                               ignore_eos=True).token_ids


def test_the_readme_second_replica_joins_the_cluster_serve_started(serve, hf_greedy):
    env, first, _ = serve
    assert (Path(env["HOME"]) / ".ray" / "auth_token").is_file()  # token auth is on
    with router(env) as replica:
        target, _ = replica.serving()
        assert greedy(target) == hf_greedy
        assert replica.terminate(timeout_s=60) == 0
    assert not replica.tracebacks(), replica.tracebacks()
    assert greedy(first) == hf_greedy  # the pool serves on


def test_a_router_without_the_token_exits_naming_what_is_missing(serve, tmp_path, hf_greedy):
    env, _, _ = serve
    stranger = user(tmp_path / "stranger", PDSERVE_REDIS_URL=env["PDSERVE_REDIS_URL"])
    with router(stranger) as replica:
        assert replica.exit_code(timeout_s=120) == 1
    said = replica.stderr.tail()
    assert "requires token authentication and no token was found" in said
    assert "RAY_AUTH_TOKEN" in said and "~/.ray/auth_token" in said
    assert "Traceback" not in said
    token = (Path(env["HOME"]) / ".ray" / "auth_token").read_text().strip()
    with router({**stranger, "RAY_AUTH_TOKEN": token}) as replica:  # given it, it joins
        target, _ = replica.serving()
        assert greedy(target) == hf_greedy
        assert replica.terminate(timeout_s=60) == 0


def test_a_cluster_serve_starts_listens_on_loopback_alone(serve, hf_greedy):
    """Every socket its processes listen on (Ray's, the workers' KV rendezvous and data
    pairs after a transfer, the APIs), TCP and UDP, over IPv4 and IPv6."""
    _, target, marker = serve
    assert greedy(target) == hf_greedy  # a KV transfer has opened its pairs
    found = listening(marker)
    names = {name for name, _, _ in found}
    assert {"gcs_server", "raylet"} <= names, found
    assert any(name.startswith("ray::") for name in names), found  # the workers
    beyond = [s for s in found if not loopback(s[1])]
    assert not beyond, beyond


@pytest.mark.parametrize("auth_mode", ["token", "disabled"])
def test_serve_and_router_join_a_cluster_with_or_without_token_auth(
        auth_mode, tmp_path, llama_dir, redis, hf_greedy):
    """`ray start --head` (as on a `ray up` head) with token authentication on or off;
    its user's HOME holds a token either way, so both commands send it."""
    env = user(tmp_path / "home", PDSERVE_REDIS_URL=redis.url)
    token = tmp_path / "home" / ".ray" / "auth_token"
    token.parent.mkdir()
    token.write_text(uuid.uuid4().hex)
    with ray_head({**env, "RAY_AUTH_MODE": auth_mode}) as address:
        prefix = ("--redis-prefix", f"pdserve-{auth_mode}")
        with FrontProcess("serve", "--model", str(llama_dir), "--ray-address", address,
                          "--grpc-port", "0", "--http-port", "0", *prefix, *ENGINE,
                          env=env) as first:
            first.serving()
            with router(env, *prefix) as replica:
                target, _ = replica.serving()
                assert greedy(target) == hf_greedy
                assert replica.terminate(timeout_s=60) == 0
            assert first.terminate(timeout_s=60) == 0
        assert not first.tracebacks(), first.tracebacks()


class ray_head:
    """`ray start --head --block` on a free port, as its own process; SIGTERM ends it
    and every Ray process it started."""

    def __init__(self, env: dict[str, str]):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        ray = shutil.which("ray", path=os.path.dirname(sys.executable))
        # short: Ray's socket paths under it must fit AF_UNIX's 107 bytes
        self.temp_dir = tempfile.TemporaryDirectory(prefix="ray-", dir="/tmp")
        self.process = subprocess.Popen(
            [ray, "start", "--head", "--block", f"--port={self.port}", "--num-cpus=4",
             "--include-dashboard=false", "--disable-usage-stats",
             f"--temp-dir={self.temp_dir.name}"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.output = Output(self.process.stdout)

    def __enter__(self) -> str:
        """The address it tells other nodes to join (its node's, not loopback)."""
        said = re.compile(r"--address='([^']+)'")
        match = next((m for m in map(said.search, self.output) if m), None)
        assert match, f"ray start said no address:\n{self.output.tail()}"
        return match.group(1)

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)
        self.temp_dir.cleanup()


def listening(marker: str) -> list[tuple[str, str, int]]:
    """(process name, address, port) of each TCP socket listening and each UDP socket
    bound by a process whose environment holds the marker (Ray's daemons and workers
    inherit it from the command that started them)."""
    owners: dict[str, str] = {}  # socket inode -> process name
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if f"PDSERVE_TEST_MARKER={marker}".encode() not in \
                    Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                continue
            name = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    owners[link[8:-1]] = os.path.basename(name)
        except OSError:  # it ended, or an fd closed, while we looked
            continue
    found = []
    for table, bound in (("tcp", "0A"), ("tcp6", "0A"), ("udp", "07"), ("udp6", "07")):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == bound and fields[9] in owners:
                address, port = fields[1].split(":")
                found.append((owners[fields[9]], _address(address), int(port, 16)))
    return found


def _address(hex_address: str) -> str:
    """/proc/net's address: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or bool(getattr(ip, "ipv4_mapped", None)
                                  and ip.ipv4_mapped.is_loopback)

"""Shared fixtures: small HF-format models built locally (no downloads)."""
from __future__ import annotations

import os

# Ray reads this at import. Without it, a call on a Ray handle after ray.shutdown()
# (a stream reader thread finishing late) silently starts a new local cluster that no
# fixture owns; when it goes away, Ray exits the whole pytest process with code 1.
os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton's kernels run in its interpreter, on CPU tensors, where there is no GPU (read
# when triton is first imported): CI tests the GPU kernels that way, slowly and exactly.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pdserve.engine.tiny_model import TinySpec, make_tiny_model, train_tokenizer  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

# Two architectures the oracle tests cover: Llama with GQA, and Qwen2-style with
# q/k/v bias, tied embeddings and a single KV head (MQA).
LLAMA_GQA = TinySpec(arch="llama", hidden_size=128, intermediate_size=256, num_layers=3,
                     num_heads=8, num_kv_heads=2, max_position_embeddings=1024,
                     init_std=0.08, seed=1)
QWEN2_TIED = TinySpec(arch="qwen2", hidden_size=128, intermediate_size=320, num_layers=2,
                      num_heads=4, num_kv_heads=1, max_position_embeddings=1024,
                      tie_word_embeddings=True, rope_theta=1e6, init_std=0.08, seed=2)
ARCHS = {"llama_gqa": LLAMA_GQA, "qwen2_tied": QWEN2_TIED}


@pytest.fixture(scope="session")
def tokenizer():
    return train_tokenizer(2048)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("models")
    return {name: make_tiny_model(root / name, spec, tokenizer=tokenizer)
            for name, spec in ARCHS.items()}


@pytest.fixture(scope="session")
def llama_dir(model_dirs):
    return model_dirs["llama_gqa"]


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    """A real redis-server of the module's own, on a free loopback port."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.kill()


@pytest.fixture(autouse=True, scope="session")
def _torch_threads():
    torch.set_num_threads(2)


# The packages that run Ray and in-process gRPC servers go last. Twice a full run's
# pytest process aborted (abseil's mutex.cc: "thread should hold at least a read lock
# on Mutex", no traceback) in engine tests that ran after them. Ray 2.60 leaves its
# core worker's io thread running after ray.shutdown() once a streaming generator was
# used; `make test` runs each Ray package in a process of its own, and a plain
# `pytest` run at least puts nothing after them.
_LAST = ("tests/bench/", "tests/cluster/", "tests/multinode/", "tests/autoscaler/")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.nodeid.startswith(_LAST))  # stable: order kept within


# A pytest process ends with os._exit once pytest has reported everything, skipping
# the interpreter's teardown: native threads that outlive the tests (gloo's, gRPC's,
# torch's) are destroyed there in no set order, and the main run of `make test`
# aborted at that point now and then ("terminate called without an active exception")
# after every test had passed. The exit status is pytest's own.
_EXIT_STATUS = pytest.StashKey[int]()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    status = config.stash.get(_EXIT_STATUS, None)
    if status is None:
        return  # no session ran (--help, a usage error): pytest exits as usual
    import sys
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)

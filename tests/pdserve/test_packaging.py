"""The distribution as users install it: one top-level import package, an SDK that
loads neither torch nor Ray, `python -m pdserve`, and CLI flags that are their
subcommand's own and documented."""
from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from pdserve.cli import build_parser, main
from pdserve.cli_flags import engine_config
from pdserve.engine.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str) -> str:
    """Runs code in a fresh interpreter outside the repository (only the installed
    package is importable) and returns its stdout."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd="/", timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


_INSTALLED_TOP_LEVEL = """
import importlib.metadata as md, importlib.util, json, pathlib
dist = md.distribution("pdserve")
names = set(dist.read_text("top_level.txt").split())
for f in dist.files:
    top = f.parts[0]
    if top.endswith((".dist-info", ".pth")) or top in ("..", "__pycache__"):
        continue
    if top.startswith("__editable__") and top.endswith("_finder.py"):
        # an editable install: the import names its finder maps
        spec = importlib.util.spec_from_file_location("finder", f.locate())
        finder = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(finder)
        names |= {name.split(".")[0] for name in finder.MAPPING}
    else:
        names.add(top.removesuffix(".py"))
print(json.dumps(sorted(names)))
"""


def test_the_installed_distribution_has_one_top_level_import_name():
    assert json.loads(_python(_INSTALLED_TOP_LEVEL)) == ["pdserve"]


def setup_folders() -> dict[str, str]:
    """setup.py's FOLDERS: each package mapped into `pdserve` -> its folder."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    (found,) = [ast.literal_eval(node.value) for node in tree.body
                if isinstance(node, ast.Assign) and node.targets[0].id == "FOLDERS"]
    return found


def tree_packages() -> set[str]:
    """Every package the repository's folders hold, as `pdserve.*` import names."""
    return {name + "".join(f".{part}" for part in init.parent.relative_to(ROOT / folder).parts)
            for name, folder in setup_folders().items()
            for init in (ROOT / folder).rglob("__init__.py") if "__pycache__" not in init.parts}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the checkout, as deploy/Dockerfile builds it."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", "bench-results", "tests"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp / "dist"), str(src)],
                   check=True, capture_output=True, timeout=300)
    (built,) = (tmp / "dist").glob("pdserve-*.whl")
    return built


def test_a_built_wheel_holds_only_the_pdserve_package_and_all_of_it(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"pdserve"}
    packed = {n.removesuffix("/__init__.py").replace("/", ".") for n in names
              if n.endswith("/__init__.py")}
    assert packed == tree_packages()  # each package of the tree, none left out
    for module in ("engine/scheduler.py", "engine/model/llama.py", "router/router.py",
                   "kv_transfer/sender.py", "prefill_worker/role.py", "worker/actor.py",
                   "decode_worker/role.py", "bench/driver.py", "v1/generate_pb2.py",
                   "engine/spec_decode/config.py"):
        assert f"pdserve/{module}" in names
    assert not [n for n in names if n.startswith("benchmarks")]  # repository scripts


def test_the_wheel_installed_alone_imports_every_module_and_runs_the_offline_demo(
        wheel, tmp_path):
    """A fresh virtual environment holding the wheel and no source tree (its
    dependencies are this environment's, reached by path, not this checkout's
    editable install), run from elsewhere: every module imports, and the offline demo
    serves the tiny model, built from scratch."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(_python_in(python, "import sysconfig; print(sysconfig.get_path('purelib'))"))
    deps = [p for p in sys.path if p.endswith("site-packages")]
    (site / "dependencies.pth").write_text("\n".join(deps) + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, capture_output=True, timeout=300)
    modules = [n.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
               for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")]
    imported = _python_in(python, "import importlib, json, sys, pdserve\n"
                          f"for m in {modules!r}: importlib.import_module(m)\n"
                          "print(json.dumps(pdserve.__file__))", cwd=tmp_path)
    assert json.loads(imported).startswith(str(site))  # the wheel's, not the checkout's
    done = subprocess.run([str(venv / "bin" / "pdserve"), "demo", "--offline",
                           "--num-prompts", "3", "--max-tokens", "4"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=600,
                          env={**os.environ, "PDSERVE_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "3 requests" in done.stdout and "12 output tokens" in done.stdout


def _python_in(python: Path, code: str, cwd: Path | str = "/") -> str:
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                          cwd=cwd, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_the_sdk_imports_neither_torch_nor_ray():
    loaded = json.loads(_python(
        "import json, sys\n"
        "import pdserve\n"
        "light = not {'torch', 'ray', 'grpc'} & set(sys.modules)\n"
        "import pdserve.client\n"
        "from pdserve import AsyncClient, Client, SamplingParams\n"
        "SamplingParams(temperature=0)\n"
        "print(json.dumps([light, 'torch' in sys.modules, 'ray' in sys.modules]))"))
    assert loaded == [True, False, False]


def test_heavy_names_still_load_on_first_use():
    assert _python("import pdserve, sys\n"
                   "print(pdserve.LLM.__module__, 'torch' in sys.modules)").split() == \
        ["pdserve.llm", "True"]


def test_python_dash_m_pdserve_is_the_command():
    for argv in (["--help"], ["bench", "run", "--help"], ["serve", "--help"]):
        done = subprocess.run([sys.executable, "-m", "pdserve", *argv], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("usage: pdserve")


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_flag_of_every_command_has_help():
    missing = [(p.prog, a.option_strings) for p in _parsers(build_parser())
               for a in p._actions
               if a.option_strings and a.dest != "help" and not (a.help or "").strip()]
    assert not missing


def test_bench_run_refuses_compare_only_flags(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "run", "--target", "127.0.0.1:1", "--slo-scale", "5"])
    assert exit_.value.code == 2
    assert "--slo-scale" in capsys.readouterr().err


def test_serve_flags_are_the_engine_config_fields_with_their_defaults():
    args = build_parser().parse_args(["serve"])
    for f in EngineConfig.flat_fields():
        assert getattr(args, f.name) == f.default, f.name
    assert engine_config(args, "m") == EngineConfig(model="m")


def test_serve_flags_reach_the_engine_config():
    args = build_parser().parse_args(
        ["serve", "--max-num-seqs", "7", "--no-enable-prefix-caching", "--policy", "priority",
         "--kv-cache-memory-bytes", "1024", "--dtype", "bfloat16", "--prioritize-prefill"])
    config = engine_config(args, "m")
    assert config.scheduler.max_num_seqs == 7 and config.scheduler.policy == "priority"
    assert config.scheduler.prioritize_prefill and not config.cache.enable_prefix_caching
    assert config.cache.kv_cache_memory_bytes == 1024 and config.dtype == "bfloat16"


def test_a_bad_flag_value_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--policy", "lifo"])
    assert "invalid choice" in capsys.readouterr().err


def test_router_timeouts_and_limits_are_flags_of_serve_router_and_sim():
    from pdserve.cli import cluster_specs, router_config
    from pdserve.router.config import RouterConfig
    from pdserve.sim.cli import setup_of

    flags = ["--placement-timeout-s", "7", "--max-inflight", "3",
             "--worker-drain-timeout-s", "9", "--max-queued-prefill-tokens", "0"]
    _, served = cluster_specs(build_parser().parse_args(["serve", *flags]))
    replica = router_config(build_parser().parse_args(["router", *flags]))
    simulated = setup_of(build_parser().parse_args(["sim", *flags])).router
    for config in (served, replica, simulated):
        assert (config.placement_timeout_s, config.max_inflight, config.worker_drain_timeout_s,
                config.max_queued_prefill_tokens) == (7, 3, 9, 0)
    defaults = router_config(build_parser().parse_args(["serve"]))
    assert all(getattr(defaults, name) == getattr(RouterConfig(), name)
               for name in RouterConfig.flags())
    assert len(RouterConfig.flags()) == 15


def test_a_bad_router_limit_exits_naming_its_flag():
    with pytest.raises(SystemExit, match=r"--stall-timeout-s must be > 0, got 0"):
        main(["serve", "--stall-timeout-s", "0"])
    with pytest.raises(SystemExit, match=r"--max-request-bytes must be >= 1"):
        main(["router", "--max-request-bytes", "0", "--redis-url", "redis://127.0.0.1:1/0"])

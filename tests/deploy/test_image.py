"""The container image (deploy/Dockerfile, .dockerignore) read as text: CI has no
Docker daemon to build it, so what must agree with the rest of the repository is
checked here: the torch pin, the Ray version, a non-root user, the build context
holding every folder the wheel carries (setup.py's, which the packaging test holds to
the built wheel), and the image name and tag the deployment files use."""
from __future__ import annotations

import fnmatch
import re

import ray
import tomllib

from tests.deploy.files import DEPLOY, KUBERAY, LAUNCHERS, ROOT, load
from tests.pdserve.test_packaging import setup_folders

DOCKERFILE = DEPLOY / "Dockerfile"


def image_errors(dockerfile: str, dockerignore: str) -> list[str]:
    """What is wrong with the image's recipe; [] when nothing is."""
    errors = []
    makefile_torch = re.search(r"^TORCH_SPEC \?= torch==(\S+)", (ROOT / "Makefile").read_text(),
                               re.M).group(1)
    torch = re.search(r"^ARG TORCH_VERSION=(\S+)", dockerfile, re.M)
    if torch is None or torch.group(1) != makefile_torch:
        errors.append(f"torch is not the Makefile's torch=={makefile_torch}")
    base = re.search(r"^ARG RAY_IMAGE=rayproject/ray:([\d.]+)-py(\d)(\d+)-cu\d+$", dockerfile,
                     re.M)
    if base is None or base.group(1) != ray.__version__:
        errors.append(f"the base is not Ray {ray.__version__}'s CUDA image")
    users = re.findall(r"^USER\s+(\S+)", dockerfile, re.M)
    if not users or users[-1].split(":")[0] in ("root", "0"):
        errors.append("the image runs as root")
    if '--index-url "${TORCH_INDEX_URL}"' not in dockerfile:
        errors.append("torch does not come from the CUDA index")
    if not re.search(r"^RUN pip install .*\.whl", dockerfile, re.M):
        errors.append("pdserve is not installed from the wheel stage")
    patterns = [line.strip() for line in dockerignore.splitlines()
                if line.strip() and not line.startswith("#")]
    sources = ["pyproject.toml", "setup.py", "README.md", *setup_folders().values()]
    for source in sources:
        if ignored(source, patterns):
            errors.append(f".dockerignore leaves out {source}, which the wheel needs")
    for kept_out in (".venv", ".git", "deploy/ray/pdserve.env"):
        if not ignored(kept_out, patterns):
            errors.append(f".dockerignore lets {kept_out} into the build context")
    return errors


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether Docker leaves `path` out of the build context: a pattern matches it or a
    folder above it (`**/x` matches x at any depth). No `!` exceptions are used."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(fnmatch.fnmatch(prefix, pattern)
               or (pattern.startswith("**/")
                   and fnmatch.fnmatch(prefix.rsplit("/", 1)[-1], pattern[3:]))
               for pattern in patterns for prefix in prefixes)


def test_the_image_recipe_agrees_with_the_repository():
    assert image_errors(DOCKERFILE.read_text(), (ROOT / ".dockerignore").read_text()) == []


def test_the_deployment_files_name_the_image_at_the_package_s_version():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    aws = load(next(p for p in LAUNCHERS if load(p)["provider"]["type"] == "aws"))
    assert aws["docker"]["image"].endswith(f"/pdserve:{version}")
    (image,) = load(KUBERAY / "kustomization.yaml")["images"]
    assert image["newTag"] == version and image["newName"].endswith("/pdserve")
    assert f"-t pdserve:{version}" in DOCKERFILE.read_text()


def test_a_broken_recipe_is_refused():
    dockerfile, dockerignore = DOCKERFILE.read_text(), (ROOT / ".dockerignore").read_text()
    assert image_errors(dockerfile + "USER root\n", dockerignore) == ["the image runs as root"]
    assert image_errors(dockerfile.replace("ARG TORCH_VERSION=2.", "ARG TORCH_VERSION=3."),
                        dockerignore)[0].startswith("torch is not the Makefile's")
    assert image_errors(dockerfile.replace("rayproject/ray:2.", "rayproject/ray:1."),
                        dockerignore)[0].startswith("the base is not Ray")
    assert image_errors(dockerfile, dockerignore + "router\n") == [
        ".dockerignore leaves out router, which the wheel needs"]
    assert image_errors(dockerfile, dockerignore.replace(".venv\n", "")) == [
        ".dockerignore lets .venv into the build context"]

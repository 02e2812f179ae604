"""Packaging: one import package, `pdserve`. The design's folders stay at the
repository's top level and are mapped in as its subpackages; every package under
each is found in the tree, so a new one cannot be left out of the wheel."""
from setuptools import find_packages, setup

FOLDERS = {
    "pdserve": "pdserve",
    "pdserve.engine": "engine",
    "pdserve.kv_transfer": "kv_transfer",
    "pdserve.prefill_worker": "prefill_worker",
    "pdserve.decode_worker": "decode_worker",
    "pdserve.worker": "worker",
    "pdserve.router": "router",
}


def packages() -> list[str]:
    return [f"{name}.{sub}" if sub else name for name, folder in FOLDERS.items()
            for sub in ["", *find_packages(folder)]]


setup(packages=packages(), package_dir=FOLDERS)

"""Collection rules for the whole workspace, and the fixtures every suite shares.

A framework adapter's tests import the framework, which lives in its own environment (a uv extra
that conflicts with the others): they are collected there (see ``.ci/run``), not in the default one.
"""

from importlib.util import find_spec

ADAPTER_FRAMEWORKS = {"packages/arctic-verl": "verl", "packages/arctic-skyrl": "skyrl"}

collect_ignore = [folder for folder, module in ADAPTER_FRAMEWORKS.items() if find_spec(module) is None]

# The fixtures every suite shares (the tiny policy, ...): this conftest is loaded in each environment.
pytest_plugins = ["arctic_core.testing"]

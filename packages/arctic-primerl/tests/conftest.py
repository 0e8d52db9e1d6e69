"""Fixtures of the arctic-primerl tests. The tiny policy (``policy``) is shared with every suite:
:mod:`arctic_core.testing`, registered by the repository's ``conftest.py``. The helper modules
beside the tests (``runs``, ``fake_orchestrator``) import as top-level modules: pytest puts this
folder (no ``__init__.py``) on ``sys.path`` when it loads this file."""

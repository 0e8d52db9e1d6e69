"""Fixtures of the arctic-verl tests. The tiny policy (``policy``) is shared with every suite:
:mod:`arctic_core.testing`, registered by the repository's ``conftest.py``."""

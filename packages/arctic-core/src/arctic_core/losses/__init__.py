"""Built-in loss terms. Each is a plugin like any other: see :mod:`arctic_core.builtins`."""

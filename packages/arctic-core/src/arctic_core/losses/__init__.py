"""Training objectives: the built-in loss terms (``policy``, ``regularizers``), how per-token
values are reduced (``aggregation``), the processors that turn logits into per-token outputs
(``processors``) and how a request's terms are composed (``objective``). Each term and processor
is a plugin like any other (see :mod:`arctic_core.plugins.builtins`)."""

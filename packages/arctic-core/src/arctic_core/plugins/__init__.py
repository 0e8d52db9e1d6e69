"""The plugin system: the hook contract (``hookspecs``), what each product must do
(``interfaces``), discovery by entry point (``registry``) and the core's own plugin (``builtins``)."""

"""The server side: the engines behind the protocol (``server``), how checkpoints reach disk
(``checkpoint_folders``) and its HTTP front (``http``, with Prometheus ``metrics``). The wire
format every transport speaks, client and server, is :mod:`arctic_core.wire` (beside
:mod:`arctic_core.protocol`; ``arctic_core.serving.wire`` until 0.3.0)."""

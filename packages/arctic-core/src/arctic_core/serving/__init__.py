"""The server side: the engines behind the protocol (``server``), how checkpoints reach disk
(``checkpoint_folders``), its HTTP front (``http``, with Prometheus ``metrics``) and the wire
format every transport speaks (``wire``)."""

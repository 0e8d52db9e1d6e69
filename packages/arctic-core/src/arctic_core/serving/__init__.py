"""The server side: the engines behind the protocol (``server``), its HTTP front (``http``, with
Prometheus ``metrics``) and the wire format every transport speaks (``wire``)."""

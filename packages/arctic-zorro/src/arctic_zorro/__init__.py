"""Arctic training and log-prob backends (the reference torch engine; DeepSpeed + ZoRRo Train next)."""

"""Arctic training and log-prob backends (DeepSpeed, and plain torch as the exact baseline) with ZoRRo Train."""

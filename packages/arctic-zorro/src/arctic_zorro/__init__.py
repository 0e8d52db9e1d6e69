"""Arctic training and log-prob backends (DeepSpeed and a plain torch reference) with ZoRRo Train."""

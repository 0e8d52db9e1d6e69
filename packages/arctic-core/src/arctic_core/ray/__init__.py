"""Backends whose engines run in Ray actors: data-parallel training ranks (``trainer``), sampler
replicas (``sampler``), a log-prob engine of its own (``logprob``), and what they share (``actors``)."""

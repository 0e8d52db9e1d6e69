"""Pieces every framework adapter (arctic-verl, arctic-skyrl, ...) shares: the settings that say
where the backend runs, and the regrouping of per-sample rollout requests into prompt groups."""

"""SkyRL's PPO trainer with Arctic as its engine.

SkyRL keeps its loop: data, the generator with its environments and rewards, advantage
estimators and loss reductions, metrics, evaluation, the checkpoint schedule. Its worker groups are
replaced by :class:`~arctic_skyrl.dispatch.ArcticDispatch`; the old and reference log-probs come
from one Arctic ``log_probs`` call each over the whole batch (SkyRL's workers would recompute them
per mini-batch to match their own micro-batch packing, which Arctic's results do not depend on).
"""

from __future__ import annotations

import torch
from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
from skyrl.train.trainer import RayPPOTrainer

from arctic_skyrl.dispatch import ArcticDispatch


class ArcticTrainer(RayPPOTrainer):
    """``RayPPOTrainer`` whose dispatch is an :class:`ArcticDispatch` (set before ``train()``)."""

    dispatch: ArcticDispatch

    @torch.no_grad()
    def fwd_logprobs_values_reward(self, training_input: TrainingInputBatch) -> TrainingInputBatch:
        """``action_log_probs`` (the policy's) and ``base_action_log_probs`` (the reference's, when a
        KL needs them) for every row, in SkyRL's right-aligned layout; no critic values."""
        algorithm = self.cfg.trainer.algorithm
        needs_reference = algorithm.use_kl_loss or algorithm.use_kl_in_reward
        log_probs = self.dispatch.log_probs(training_input, ("policy", "ref") if needs_reference else ("policy",))
        training_input["base_action_log_probs"] = log_probs.get("ref")
        training_input["action_log_probs"] = policy = log_probs["policy"]
        training_input["values"] = None
        rollout = training_input.get("rollout_logprobs")
        mask = training_input["loss_mask"] > 0
        if rollout is not None and mask.any():  # SkyRL's sampler-vs-trainer diagnostics
            diff = (rollout[mask] - policy[mask]).abs()
            self.all_metrics.update({f"policy/rollout_train_logprobs_abs_diff_{name}": float(value) for name, value in
                                     (("max", diff.max()), ("min", diff.min()), ("mean", diff.mean()),
                                      ("std", diff.std()))})
        return training_input

"""The reference sampler: transformers ``generate`` with n samples per prompt.

Simple and exact; it returns the sampling log-probs (of the distribution actually sampled from,
after temperature / top-k / top-p) and stamps every response with the policy version of its weights.
"""

from __future__ import annotations

import torch

from arctic_core.batch import RolloutBatch
from arctic_core.config import ModelConfig, SamplerConfig, SamplingParams, StrictModel, validate_options
from arctic_core.errors import engine_asleep
from arctic_core.hf import check_prompts, copy_weights_, load_causal_lm, max_positions, stop_tokens
from arctic_core.plugins.interfaces import NamedTensors


class HFSamplerOptions(StrictModel):
    """The reference sampler takes no backend-specific options (any key is a typo)."""


class HFGenerateSampler:
    """Samples with ``transformers.GenerationMixin.generate``; weights are updated in place."""

    options_model = HFSamplerOptions

    def __init__(self, config: SamplerConfig, model: ModelConfig, *, seed: int) -> None:
        validate_options(self.options_model, config, "hf-generate")
        self.config = config
        self.seed = seed
        self.model = load_causal_lm(model)
        self.model.eval()
        self.device = next(self.model.parameters()).device
        self.policy_version = 0
        self.asleep = False
        self.calls = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        if self.asleep:
            raise engine_asleep("sampler")
        check_prompts(prompts, self.model.config.vocab_size, params, max_positions(self.model))
        stops = sorted(stop_tokens(self.model, params))
        per_chunk = max(1, self.config.max_batch_size // params.n)
        seed = params.seed if params.seed is not None else self.seed + self.calls
        self.calls += 1
        responses: list[list[int]] = []
        logprobs: list[list[float]] = []
        for start in range(0, len(prompts), per_chunk):
            chunk = prompts[start : start + per_chunk]
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                torch.manual_seed(seed + start)
                r, lp = self._generate_chunk(chunk, params, stops)
            responses += r
            logprobs += lp
        index = [p for p in range(len(prompts)) for _ in range(params.n)]
        return RolloutBatch.from_samples(prompts, responses, index, logprobs, self.policy_version)

    @torch.no_grad()
    def _generate_chunk(
        self, prompts: list[list[int]], params: SamplingParams, stops: list[int]
    ) -> tuple[list[list[int]], list[list[float]]]:
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: generation continues every row at the same column
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        sampling = {} if params.greedy else {"temperature": params.temperature, "top_p": params.top_p,
                                             "top_k": params.top_k, "min_p": params.min_p or None}
        if params.repetition_penalty != 1.0:
            sampling["repetition_penalty"] = params.repetition_penalty
        out = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            do_sample=not params.greedy,
            num_return_sequences=params.n,
            max_new_tokens=params.max_tokens,
            # transformers falls back to the model's eos for an empty list: an id it never samples instead
            eos_token_id=stops or [self.model.config.vocab_size],
            pad_token_id=stops[0] if stops else 0,
            output_scores=True,
            return_dict_in_generate=True,
            **sampling,
        )
        new = out.sequences[:, width:].cpu()
        scores = torch.stack(out.scores, dim=1).float().log_softmax(-1).cpu()  # [rows, steps, V]
        chosen = scores.gather(-1, new[..., None]).squeeze(-1)
        responses, logprobs = [], []
        for row in range(new.shape[0]):
            length = _length_through_stop(new[row].tolist(), stops)
            responses.append(new[row, :length].tolist())
            logprobs.append(chosen[row, :length].tolist())
        return responses, logprobs

    def update_weights(self, weights: NamedTensors, version: int) -> None:
        copy_weights_(self.model, weights)
        self.policy_version = version

    def sleep(self) -> None:
        self.model.to("cpu")
        self.asleep = True

    def wake(self) -> None:
        self.model.to(self.device)
        self.asleep = False

    def shutdown(self) -> None:
        self.asleep = True


def _length_through_stop(tokens: list[int], stops: list[int]) -> int:
    """Tokens up to and including the first stop token (all of them when none occurs)."""
    for i, tok in enumerate(tokens):
        if tok in stops:
            return i + 1
    return len(tokens)

"""The rollout batch: the one data format every step of Arctic passes along.

A GRPO batch is a set of prompts, each answered N times. :class:`RolloutBatch` stores it that way:
each prompt's token ids once (``prompt_ids``), every response (``response_ids``) and, per
response, the index of its prompt (``prompt_index``). A trainer therefore knows exactly which rows
share a prompt (no guessing from token equality), which is what ZoRRo needs to pack a prompt once.

Ragged lengths are stored right-padded with explicit lengths; every per-token field is
``[num_responses, max_response_len]`` aligned with ``response_ids``. All fields are tensors, so a
batch round-trips through safetensors with no pickle.

Layout (B responses, P prompts, Lp / Lr the padded prompt / response widths)::

    prompt_ids        int64   [P, Lp]   right-padded with 0
    prompt_lens       int64   [P]       >= 1
    response_ids      int64   [B, Lr]   right-padded with 0
    response_lens     int64   [B]       >= 0
    prompt_index      int64   [B]       in [0, P)
    loss_mask         bool    [B, Lr]   tokens that count in a loss (default: the real tokens)
    old_logprobs      float   [B, Lr]   optional: log-probs of the policy that sampled / old policy
    ref_logprobs      float   [B, Lr]   optional: reference-model log-probs (KL)
    sampling_logprobs float   [B, Lr]   optional: what the sampler reported
    advantages        float   [B] or [B, Lr]   optional
    rewards           float   [B]       optional
    policy_version    int64   [B]       optional: weight version that generated each response (the
                                        oldest of its tokens' versions when they differ)
    token_policy_version int64 [B, Lr]  optional: weight version that sampled each response token
                                        (a weight sync while a sample runs: its later tokens carry
                                        the new version; ``version_range()`` gives min and max per response)
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from arctic_core.errors import BatchError

TOKEN_FIELDS = ("old_logprobs", "ref_logprobs", "sampling_logprobs")
"""Optional float fields shaped like ``response_ids``."""
WIDENED_INTEGERS = (torch.int8, torch.int16, torch.uint8, torch.uint16, torch.uint32)
"""Integer dtypes a batch takes and widens to int64 (the index types torch's gathers take are int32/64)."""


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor.to(device)``, without blocking the host when a host tensor goes to a GPU.

    A copy from pageable memory first waits for all the work queued on the device, so the host
    could not prepare the next micro-batch while the device finishes the last one; a pinned copy
    is queued behind that work instead."""
    if tensor.device.type == "cpu" and torch.device(device).type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _pad_rows(rows: Sequence[Sequence[int]], what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad integer rows into ``[n, max_len]`` plus their lengths. Through numpy: a sampler's
    answer is one such batch per call, and numpy reads a list of ints about 4x faster than torch."""
    lens = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    out = np.zeros((len(rows), int(lens.max()) if len(rows) else 0), dtype=np.int64)
    for i, row in enumerate(rows):
        if len(row):
            out[i, : len(row)] = _integer_row(row, what, i)
    return torch.from_numpy(out), torch.from_numpy(lens)


def _integer_row(row: Sequence[int], what: str, i: int) -> np.ndarray | torch.Tensor:
    try:
        values = np.asarray(row)
        if values.dtype.kind == "i" or (values.dtype.kind == "u" and values.dtype.itemsize < 8):
            return values
    except (TypeError, ValueError, RuntimeError, OverflowError):
        pass  # torch says what is wrong with it
    try:
        tensor = torch.as_tensor(row)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise BatchError(f"{what}[{i}] must be a sequence of integer token ids: {exc}") from exc
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise BatchError(f"{what}[{i}] must be a sequence of integer token ids, got {tensor.dtype} values")
    return tensor.cpu()


def _number_rows(rows: Sequence[Sequence[float]], width: int, dtype: type) -> torch.Tensor:
    """Rows of numbers, right-padded with zeros into ``[len(rows), width]``."""
    out = np.zeros((len(rows), width), dtype=dtype)
    for i, values in enumerate(rows):
        out[i, : len(values)] = np.asarray(values, dtype=dtype)
    return torch.from_numpy(out)


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _as_float(name: str, value: torch.Tensor | None) -> torch.Tensor | None:
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value)
    if value.dtype not in FLOAT_DTYPES:  # float8 types have no arithmetic to compute a loss with
        raise BatchError(f"{name} must be a float16, bfloat16, float32 or float64 tensor, got dtype {value.dtype}")
    return value


@dataclass
class RolloutBatch:
    """Prompts stored once, their responses, and per-response training signals (see module doc)."""

    prompt_ids: torch.Tensor
    prompt_lens: torch.Tensor
    response_ids: torch.Tensor
    response_lens: torch.Tensor
    prompt_index: torch.Tensor
    loss_mask: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    sampling_logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    policy_version: torch.Tensor | None = None
    token_policy_version: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._check_ids()
        if self.loss_mask is None:
            self.loss_mask = self.response_token_mask()
        self._check_token_fields()
        self._check_row_fields()

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_lists(
        cls,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        prompt_index: Sequence[int],
        **fields: torch.Tensor | None,
    ) -> RolloutBatch:
        """Build from Python token lists: ``prompts[prompt_index[i]]`` is response ``i``'s prompt.

        Per-token fields may be given as ``[B, Lr]`` tensors aligned with the padded responses.
        """
        prompt_ids, prompt_lens = _pad_rows(prompts, "prompts")
        response_ids, response_lens = _pad_rows(responses, "responses")
        index = torch.as_tensor(list(prompt_index), dtype=torch.long)
        return cls(prompt_ids, prompt_lens, response_ids, response_lens, index, **fields)

    @classmethod
    def from_samples(
        cls,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        prompt_index: Sequence[int],
        sampling_logprobs: Sequence[Sequence[float]],
        policy_version: int | Sequence[int],
        token_policy_version: Sequence[Sequence[int]] | None = None,
    ) -> RolloutBatch:
        """A sampler's result: ``from_lists`` plus each response's sampling log-probs (one per token)
        and the policy version it was generated with (one for all, or one per response); with
        ``token_policy_version`` (one per token), each response's ``policy_version`` is its oldest."""
        width = max((len(r) for r in responses), default=0)
        given = torch.as_tensor(policy_version, dtype=torch.long).expand(len(responses)).clone()
        versions, per_token = given, None
        if token_policy_version is not None:  # padding keeps the version given for the response
            lens = torch.tensor([len(v) for v in token_policy_version], dtype=torch.long)
            per_token = torch.where(torch.arange(width) < lens[:, None],
                                    _number_rows(token_policy_version, width, np.int64), given[:, None])
            versions = torch.tensor([min(v) if len(v) else int(given[row])
                                     for row, v in enumerate(token_policy_version)], dtype=torch.long)
        return cls.from_lists(prompts, responses, prompt_index,
                              sampling_logprobs=_number_rows(sampling_logprobs, width, np.float32),
                              policy_version=versions, token_policy_version=per_token)

    @classmethod
    def from_padded(
        cls,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        prompt_length: int,
        group_ids: Sequence[object] | torch.Tensor | None = None,
        response_mask: torch.Tensor | None = None,
        **fields: torch.Tensor | None,
    ) -> RolloutBatch:
        """Convert the frameworks' padded layout into a grouped batch.

        ``input_ids`` / ``attention_mask`` are ``[B, prompt_length + R]``: the prompt part is
        left-padded (verl, TRL), the response part right-padded. ``group_ids`` (verl's ``uid``,
        TRL's prompt index) says which rows share a prompt; rows of one group must hold identical
        prompt tokens. Without ``group_ids`` rows are grouped by exact prompt-token equality.
        ``response_mask`` (``[B, R]``) marks the tokens that count in a loss, e.g. with tool
        output masked out; it defaults to the response part of ``attention_mask``.
        Per-token ``fields`` are ``[B, R]``; per-row ones ``[B]``.
        """
        for name, value in (("input_ids", input_ids), ("attention_mask", attention_mask)):
            if not isinstance(value, torch.Tensor):
                raise BatchError(f"{name} must be a [B, T] tensor, got {type(value).__name__} (from_lists takes "
                                 "token lists)")
        if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
            raise BatchError(
                f"input_ids and attention_mask must both be [B, T]; got {tuple(input_ids.shape)} "
                f"and {tuple(attention_mask.shape)}"
            )
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise BatchError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        if not 0 < prompt_length <= input_ids.shape[1]:
            raise BatchError(f"prompt_length {prompt_length} outside (0, {input_ids.shape[1]}]")
        mask = attention_mask.bool()
        resp_mask = mask[:, prompt_length:]
        resp_lens = resp_mask.sum(dim=1)
        if not torch.equal(resp_mask, _prefix_mask(resp_lens, resp_mask.shape[1])):
            raise BatchError("the response part of attention_mask must be right-padded (1s then 0s)")
        # Tensor ops throughout: a row's prompt of thousands of tokens never becomes a Python list.
        prompts, prompt_lens = _compact_rows(input_ids[:, :prompt_length], mask[:, :prompt_length])
        firsts, index = _group_rows(prompts, prompt_lens, group_ids)
        width = int(resp_lens.max()) if len(resp_lens) else 0
        responses = torch.where(resp_mask, input_ids[:, prompt_length:], 0)[:, :width]
        if response_mask is not None:
            fields["loss_mask"] = response_mask.bool() & resp_mask
        return cls(prompts[firsts].long(), prompt_lens[firsts], responses.long(), resp_lens, index, **fields)

    def to_padded(self, pad_id: int = 0) -> dict[str, torch.Tensor]:
        """The padded layout frameworks use: left-padded prompts, right-padded responses.

        Returns ``input_ids``, ``attention_mask`` and ``position_ids`` ``[B, Lp + Lr]``, plus
        ``responses`` and ``response_mask`` ``[B, Lr]`` (the loss mask).
        """
        width_p = self.prompt_ids.shape[1]
        lens_p = self.prompt_lens[self.prompt_index]
        prompt_mask = _prefix_mask(lens_p, width_p).flip(1)
        prompts = torch.full((self.num_responses, width_p), pad_id, dtype=torch.long)
        source = self.prompt_ids[self.prompt_index]
        for i, n in enumerate(lens_p.tolist()):
            prompts[i, width_p - n :] = source[i, :n]
        resp_mask = self.response_token_mask()
        responses = torch.where(resp_mask, self.response_ids, torch.full_like(self.response_ids, pad_id))
        attention = torch.cat([prompt_mask, resp_mask], dim=1).long()
        positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
        return {
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention,
            "position_ids": positions,
            "responses": responses,
            "response_mask": self.loss_mask.long(),
        }

    # ----------------------------------------------------------------- views
    @property
    def num_responses(self) -> int:
        return int(self.response_ids.shape[0])

    @property
    def num_prompts(self) -> int:
        return int(self.prompt_ids.shape[0])

    def response_token_mask(self) -> torch.Tensor:
        """``[B, Lr]`` bool: True on real (non-padding) response tokens."""
        return _prefix_mask(self.response_lens, self.response_ids.shape[1])

    def prompt(self, i: int) -> list[int]:
        """Token ids of response ``i``'s prompt."""
        p = int(self.prompt_index[i])
        return self.prompt_ids[p, : int(self.prompt_lens[p])].tolist()

    def response(self, i: int) -> list[int]:
        return self.response_ids[i, : int(self.response_lens[i])].tolist()

    def groups(self) -> list[list[int]]:
        """Response row indices of each prompt, in prompt order."""
        out: list[list[int]] = [[] for _ in range(self.num_prompts)]
        for row, p in enumerate(self.prompt_index.tolist()):
            out[p].append(row)
        return out

    def sequence_lens(self) -> torch.Tensor:
        """``[B]``: each row's prompt + response length."""
        return self.prompt_lens[self.prompt_index] + self.response_lens

    def total_tokens(self) -> int:
        """Tokens of the plain (non-deduplicated) batch: sum of prompt + response lengths."""
        return int(self.sequence_lens().sum())

    def sequences(self) -> list[torch.Tensor]:
        """``prompt + response`` token ids of every row (int64, CPU)."""
        prompts = [self.prompt_ids[p, : int(n)] for p, n in enumerate(self.prompt_lens)]
        return [torch.cat([prompts[int(p)], self.response_ids[i, : int(self.response_lens[i])]])
                for i, p in enumerate(self.prompt_index)]

    def prefix_order(self) -> tuple[list[torch.Tensor], list[int], list[int]]:
        """The rows' sequences, the rows in lexicographic order of them, and for each row in that
        order how many leading tokens it shares with the row before it: the row adds only the rest
        as new nodes of the prefix forest (one sort builds the whole trie)."""
        sequences = self.sequences()
        as_lists = [s.tolist() for s in sequences]
        order = sorted(range(len(sequences)), key=as_lists.__getitem__)
        shared = [0] * len(order)
        for k in range(1, len(order)):
            a, b = sequences[order[k - 1]], sequences[order[k]]
            n = min(a.shape[0], b.shape[0])
            differ = (a[:n] != b[:n]).nonzero()
            shared[k] = int(differ[0]) if differ.numel() else n
        return sequences, order, shared

    def packed_tokens(self) -> int:
        """Tokens once every shared prefix is stored once (a group's prompt, a multi-turn history
        that later steps extend): the node count of the prefix forest a packed forward computes on."""
        sequences, order, shared = self.prefix_order()
        return sum(sequences[row].shape[0] - common for row, common in zip(order, shared, strict=True))

    def replace(self, **changes: object) -> RolloutBatch:
        """A copy with some fields replaced (validated again)."""
        return dataclasses.replace(self, **changes)

    def select(self, rows: Sequence[int] | torch.Tensor) -> RolloutBatch:
        """The sub-batch of the given response rows, keeping only the prompts they use."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        used, new_index = torch.unique(self.prompt_index[rows], return_inverse=True)
        width_r = int(self.response_lens[rows].max()) if len(rows) else 0
        width_p = int(self.prompt_lens[used].max()) if len(used) else 0
        changes: dict[str, object] = {
            "prompt_ids": self.prompt_ids[used, :width_p],
            "prompt_lens": self.prompt_lens[used],
            "response_ids": self.response_ids[rows, :width_r],
            "response_lens": self.response_lens[rows],
            "prompt_index": new_index.reshape(-1),
            "loss_mask": self.loss_mask[rows, :width_r],
            "extras": {k: v[rows] for k, v in self.extras.items()},
        }
        for name in (*TOKEN_FIELDS, "advantages", "rewards", "policy_version", "token_policy_version"):
            value = getattr(self, name)
            if value is not None:
                value = value[rows]
                changes[name] = value[:, :width_r] if value.dim() == 2 else value
        return self.replace(**changes)

    def to(self, device: torch.device | str) -> RolloutBatch:
        """The same batch with every tensor on ``device`` (itself when already there)."""
        if self.prompt_ids.device == torch.device(device):
            return self
        # Not validated again (a copy does not call __post_init__): on a GPU each check would
        # read a device value, and so wait for all the work queued before the copies.
        moved = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                setattr(moved, name, to_device(value, device))
        moved.extras = {k: to_device(v, device) for k, v in self.extras.items()}
        return moved

    # ----------------------------------------------------------------- wire
    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Flat ``{name: tensor}`` (None fields omitted; extras prefixed ``extras.``)."""
        out = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "extras" and getattr(self, f.name) is not None
        }
        out.update({f"extras.{k}": v for k, v in self.extras.items()})
        return {k: v.contiguous() for k, v in out.items()}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> RolloutBatch:
        """Inverse of :meth:`to_tensors`; unknown or missing names are reported by name."""
        known = {f.name for f in dataclasses.fields(cls)} - {"extras"}
        plain = {k: v for k, v in tensors.items() if not k.startswith("extras.")}
        unknown = sorted(set(plain) - known)
        if unknown:
            raise BatchError(f"unknown batch field(s) {unknown}; known fields: {sorted(known)}")
        required = ("prompt_ids", "prompt_lens", "response_ids", "response_lens", "prompt_index")
        missing = sorted(n for n in required if n not in plain)
        if missing:
            raise BatchError(f"missing required batch field(s) {missing}")
        extras = {k.removeprefix("extras."): v for k, v in tensors.items() if k.startswith("extras.")}
        return cls(**plain, extras=extras)

    # ----------------------------------------------------------------- validation
    def _check_ids(self) -> None:
        for name, dims in (("prompt_ids", 2), ("response_ids", 2), ("prompt_lens", 1), ("response_lens", 1),
                           ("prompt_index", 1)):
            setattr(self, name, _as_integers(name, getattr(self, name), dims))
        num_p, num_b = self.prompt_ids.shape[0], self.response_ids.shape[0]
        _check_len("prompt_lens", self.prompt_lens, num_p, "prompts")
        _check_len("response_lens", self.response_lens, num_b, "responses")
        _check_len("prompt_index", self.prompt_index, num_b, "responses")
        _check_lens("prompt_lens", self.prompt_lens, 1, self.prompt_ids.shape[1], "prompt {} is empty")
        _check_lens("response_lens", self.response_lens, 0, self.response_ids.shape[1], "response {} is negative")
        if num_b and (self.prompt_index.min() < 0 or self.prompt_index.max() >= num_p):
            raise BatchError(f"prompt_index must lie in [0, {num_p}) (the number of prompts)")
        if (self.prompt_ids < 0).any() or (self.response_ids < 0).any():
            raise BatchError("token ids must be non-negative")

    def _check_token_fields(self) -> None:
        shape = tuple(self.response_ids.shape)
        if self.loss_mask.dtype != torch.bool:
            if not bool(((self.loss_mask == 0) | (self.loss_mask == 1)).all()):  # a weight is not a mask
                raise BatchError(f"loss_mask must be bool (or 0/1), got values other than 0 and 1 in a "
                                 f"{self.loss_mask.dtype} tensor")
            self.loss_mask = self.loss_mask.bool()
        if tuple(self.loss_mask.shape) != shape:
            raise BatchError(f"loss_mask must be [B, Lr] = {list(shape)}, got {list(self.loss_mask.shape)}")
        if (self.loss_mask & ~self.response_token_mask()).any():
            raise BatchError("loss_mask marks padding positions beyond response_lens")
        for name in TOKEN_FIELDS:
            value = _as_float(name, getattr(self, name))
            if value is not None:
                if tuple(value.shape) != shape:
                    raise BatchError(f"{name} must be [B, Lr] = {list(shape)}, got {list(value.shape)}")
                value = _finite_where_read(name, value, self.loss_mask)
                _check_log_probabilities(name, value, self.loss_mask)
            setattr(self, name, value)

    def _check_row_fields(self) -> None:
        num_b, width = self.response_ids.shape
        self.advantages = _as_float("advantages", self.advantages)
        if self.advantages is not None:
            if tuple(self.advantages.shape) not in ((num_b,), (num_b, width)):
                raise BatchError(f"advantages must be [B] or [B, Lr] = [{num_b}] or [{num_b}, {width}], "
                                 f"got {list(self.advantages.shape)}")
            read = self.loss_mask if self.advantages.dim() == 2 else self.loss_mask.any(dim=1)
            self.advantages = _finite_where_read("advantages", self.advantages, read)
        self.rewards = _as_float("rewards", self.rewards)
        if self.rewards is not None:
            if self.rewards.dim() != 1:
                raise BatchError(f"rewards must be [B] = [{num_b}], got {list(self.rewards.shape)}")
            _check_len("rewards", self.rewards, num_b, "responses")
            self.rewards = _finite_where_read("rewards", self.rewards, torch.ones_like(self.rewards, dtype=torch.bool))
        if self.policy_version is not None:
            self.policy_version = _as_integers("policy_version", self.policy_version, dims=1)
            _check_len("policy_version", self.policy_version, num_b, "responses")
        if self.token_policy_version is not None:
            self.token_policy_version = _as_integers("token_policy_version", self.token_policy_version, dims=2)
            if tuple(self.token_policy_version.shape) != (num_b, width):
                raise BatchError(f"token_policy_version must be [B, Lr] = [{num_b}, {width}], "
                                 f"got {list(self.token_policy_version.shape)}")
        for name, value in self.extras.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != num_b:
                raise BatchError(f"extras[{name!r}] must be a tensor whose first dimension is B={num_b}")

    def version_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per response, the oldest and newest policy version among its tokens ``([B], [B])``
        (``policy_version`` for both when the batch has no per-token versions)."""
        if self.token_policy_version is None:
            if self.policy_version is None:
                raise BatchError("this batch carries no policy versions")
            return self.policy_version, self.policy_version
        real = self.response_token_mask()
        big = torch.iinfo(torch.long).max
        oldest = self.token_policy_version.masked_fill(~real, big).amin(1)
        newest = self.token_policy_version.masked_fill(~real, -big).amax(1)
        fallback = self.policy_version if self.policy_version is not None else torch.zeros_like(oldest)
        empty = self.response_lens == 0
        return torch.where(empty, fallback, oldest), torch.where(empty, fallback, newest)

    def token_advantages(self) -> torch.Tensor:
        """Advantages broadcast to ``[B, Lr]``."""
        if self.advantages is None:
            raise BatchError("this loss needs advantages, but the batch has none")
        adv = self.advantages
        return adv[:, None].expand_as(self.response_ids).to(torch.float32) if adv.dim() == 1 else adv


def _check_lens(name: str, lens: torch.Tensor, low: int, high: int, below: str) -> None:
    """Each of ``lens`` in ``[low, high]``; the first outside is named (``below``: what one under
    ``low`` means)."""
    outside = ((lens < low) | (lens > high)).nonzero()
    if len(outside):
        row = int(outside[0])
        what = below.format(row) if lens[row] < low else f"over the padded width {high}"
        raise BatchError(f"{name}[{row}] = {int(lens[row])}: {what}")


def _prefix_mask(lens: torch.Tensor, width: int) -> torch.Tensor:
    return torch.arange(width, device=lens.device)[None, :] < lens[:, None]


def _finite_where_read(name: str, value: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
    """``value`` with its NaN/inf entries where ``read`` is False set to 0; one where it is True
    (a position a loss reads) is refused. Padding and masked tokens do not enter a loss, but a NaN
    times a zero mask is NaN, in the loss and in its gradient."""
    finite = torch.isfinite(value)
    if bool(finite.all()):
        return value
    bad = ~finite & read.to(value.device)
    if bool(bad.any()):
        at = tuple(int(i) for i in bad.nonzero()[0])
        raise BatchError(f"{name} must be finite (padding and masked-out tokens excepted); "
                         f"{name}{list(at)} = {value[at].item()}")
    return value.masked_fill(~finite, 0.0)


def _check_log_probabilities(name: str, value: torch.Tensor, read: torch.Tensor) -> None:
    """Refuse log-probs that cannot be any: one above 1 (rounding in bf16 moves a log-prob near 0 by
    far less), or all of them above 0. Negative log-likelihoods or probabilities passed by mistake
    would otherwise train silently on ratios that clipping hides."""
    read_values = value[read.to(value.device)]
    if read_values.numel() == 0:
        return
    largest, none_below_zero = int(read_values.argmax()), bool((read_values > 0).all())
    if float(read_values[largest]) > 1.0 or none_below_zero:
        at = tuple(int(i) for i in read.nonzero()[largest])
        also = " and no entry below 0" if none_below_zero else ""
        raise BatchError(f"{name} must be log-probabilities (at most 0), got {name}{list(at)} = {value[at].item():.4g}"
                         f"{also}; were negative log-likelihoods or probabilities passed?")


def _as_integers(name: str, value: object, dims: int) -> torch.Tensor:
    """``value`` as int64 or int32 (the index types torch's gathers take); narrower integer types
    are widened to int64, other dtypes refused by name."""
    if not isinstance(value, torch.Tensor):
        raise BatchError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() != dims:
        raise BatchError(f"{name} must have {dims} dimension(s), got shape {list(value.shape)}")
    if value.dtype in (torch.int64, torch.int32):
        return value
    if value.dtype in WIDENED_INTEGERS:
        return value.long()
    raise BatchError(f"{name} must hold integers (int64 or int32), got dtype {value.dtype}")


def _check_len(name: str, value: torch.Tensor, expected: int, what: str) -> None:
    if value.shape[0] != expected:
        raise BatchError(f"{name} has {value.shape[0]} entries but the batch has {expected} {what}")


def _compact_rows(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's masked-in tokens moved to its front, in order, zeros after them; and their counts."""
    lens = mask.sum(dim=1)
    kept_first = torch.sort((~mask).to(torch.uint8), dim=1, stable=True).indices
    compact = torch.where(_prefix_mask(lens, ids.shape[1]), ids.gather(1, kept_first), 0)
    return compact[:, : int(lens.max()) if len(lens) else 0], lens


def _group_rows(prompts: torch.Tensor, lens: torch.Tensor,
                group_ids: Sequence[object] | torch.Tensor | None) -> tuple[list[int], torch.Tensor]:
    """The first row of each group (in order of appearance) and each row's group, by group id or by
    exact token equality; rows given one group id must hold the same prompt."""
    rows = torch.cat([lens[:, None], prompts], dim=1)  # the length too: a trailing token 0 is not padding
    if group_ids is None:
        keys = torch.unique(rows, dim=0, return_inverse=True)[1].tolist() if len(rows) else []
    else:
        keys = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
        if len(keys) != len(rows):
            raise BatchError(f"group_ids has {len(keys)} entries for {len(rows)} rows")
    first: dict[object, int] = {}
    for row, key in enumerate(keys):
        first.setdefault(key, row)
    number = {key: i for i, key in enumerate(first)}
    index = torch.tensor([number[key] for key in keys], dtype=torch.long)
    firsts = list(first.values())
    differs = (rows != rows[torch.tensor(firsts, dtype=torch.long)[index]]).any(dim=1).nonzero()
    if differs.numel():
        row = int(differs[0])
        raise BatchError(f"row {row} is in group {keys[row]!r} but its prompt tokens differ from the group's")
    return firsts, index

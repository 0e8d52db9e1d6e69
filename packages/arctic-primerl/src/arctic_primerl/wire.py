"""PRIME-RL's rollout wire format: what its orchestrator writes for the trainer each step.

One file per trainer rank and step, ``rollouts/step_{N}/rank_{R}.bin``, holds a msgpack array of
micro-batches; each micro-batch is a positional array of the fields below, in this order
(msgspec ``array_like``; nil for an absent field). The schema is PRIME-RL's
``prime_rl/transports/rollouts/types.py`` at :data:`PRIME_RL_COMMIT`. The wire carries no version
field, so the field count is the check: a micro-batch with another arity comes from another
version of PRIME-RL and is refused by name rather than misread.
"""

from __future__ import annotations

import msgspec

PRIME_RL_VERSION = "0.8.0"
PRIME_RL_COMMIT = "559b44772e471d1538537b8805cc77f3824a5e64"
"""The PRIME-RL source these schemas and routes are written from."""


class EncodedTensor(msgspec.Struct, array_like=True, gc=False):
    dtype: str
    shape: list[int]
    data: bytes


class RoutedExperts(msgspec.Struct, array_like=True, gc=False):
    data: bytes
    shape: list[int]
    dtype: str


class MicroBatch(msgspec.Struct, array_like=True, gc=False):
    """Samples packed along one row: ``position_ids`` restart at 0 for each sample and
    ``sequence_lengths`` gives each sample's length (padding belongs to the last one)."""

    input_ids: list[int]
    loss_mask: list[bool]
    advantages: list[float]
    inference_logprobs: list[float]
    position_ids: list[int]
    sequence_lengths: list[int]
    temperatures: list[float]
    env_names: list[str]
    seq_lens: list[int]
    ref_logprobs: list[float] | None = None
    routed_experts: RoutedExperts | None = None
    mm_kwargs: dict[str, EncodedTensor] | None = None
    mm_token_type_ids: list[int] | None = None
    rl_weights: list[float] | None = None
    ce_weights: list[float] | None = None
    ref_kl_weights: list[float] | None = None


FIELDS = MicroBatch.__struct_fields__
_decoder = msgspec.msgpack.Decoder(list[MicroBatch])
_encoder = msgspec.msgpack.Encoder()


class WireError(ValueError):
    """A rollout file that is not PRIME-RL's micro-batch list of the supported version."""


def decode(payload: bytes, source: str = "rollout file") -> list[MicroBatch]:
    """The micro-batches of one rank's rollout file; a wrong schema is named, not misread."""
    arity = _arities(payload)
    if arity and arity != {len(FIELDS)}:
        raise WireError(f"{source}: micro-batches have {sorted(arity)} fields, PRIME-RL {PRIME_RL_VERSION} "
                        f"(commit {PRIME_RL_COMMIT[:9]}) writes {len(FIELDS)}: run the orchestrator of that version")
    try:
        batches = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise WireError(f"{source}: not a PRIME-RL micro-batch list ({exc})") from None
    for i, batch in enumerate(batches):
        check(batch, f"{source}, micro-batch {i}")
    return batches


def encode(batches: list[MicroBatch]) -> bytes:
    return _encoder.encode(batches)


def _arities(payload: bytes) -> set[int]:
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise WireError(f"not msgpack ({exc})") from None
    if not isinstance(raw, list) or not all(isinstance(mb, list) for mb in raw):
        raise WireError("expected a msgpack array of micro-batch arrays")
    return {len(mb) for mb in raw}


def check(batch: MicroBatch, where: str) -> None:
    """Every per-token stream is as long as ``input_ids`` and the samples tile the row."""
    n = len(batch.input_ids)
    for name in ("loss_mask", "advantages", "inference_logprobs", "position_ids", "temperatures", "env_names",
                 "ref_logprobs", "mm_token_type_ids", "rl_weights", "ce_weights", "ref_kl_weights"):
        value = getattr(batch, name)
        if value is not None and len(value) != n:
            raise WireError(f"{where}: {name} has {len(value)} entries for {n} input_ids")
    if sum(batch.sequence_lengths) != n or any(length <= 0 for length in batch.sequence_lengths):
        raise WireError(f"{where}: sequence_lengths {batch.sequence_lengths} do not tile the {n} tokens")

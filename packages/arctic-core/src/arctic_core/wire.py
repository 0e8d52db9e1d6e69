"""The wire format: every protocol message as one safetensors blob, never pickle.

A message's tensors are the blob's tensors, named ``<field>.<name>``: a :class:`RolloutBatch`
field contributes ``batch.prompt_ids``, ``batch.response_ids``, ... (its ``to_tensors`` names),
and a ``dict[str, Tensor]`` field such as :class:`LogProbsResult`'s ``outputs`` contributes
``outputs.logprobs``, ... Every other field travels as JSON in the safetensors metadata under
the key ``arctic``; the key ``arctic.message`` names the model, so a blob sent to the wrong
operation is refused by name.

Decoding trusts nothing: truncated or garbage bytes, unknown tensor names, missing fields and
wrong dtypes or shapes raise :class:`RequestError` / :class:`BatchError` with a message naming the
problem (the same checks as in process: pydantic models and ``RolloutBatch.from_tensors``).
"""

from __future__ import annotations

import json
import struct
import typing
from typing import Any

import torch
from pydantic import ValidationError
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from arctic_core.batch import RolloutBatch
from arctic_core.config import format_validation_error
from arctic_core.errors import RequestError
from arctic_core.protocol import OPS, Message, Result

CONTENT_TYPE = "application/vnd.arctic.safetensors"
JSON_KEY = "arctic"
MESSAGE_KEY = "arctic.message"
_MAX_HEADER = 100 * 2**20  # safetensors' own cap on the JSON header


# ----------------------------------------------------------------- which fields are tensors
def _tensor_fields(schema: type[Message]) -> dict[str, str]:
    """``{field: "batch" | "tensors"}`` for the fields of ``schema`` that travel as tensors."""
    kinds: dict[str, str] = {}
    for name, info in schema.model_fields.items():
        annotation = info.annotation
        if annotation is RolloutBatch:
            kinds[name] = "batch"
        elif typing.get_origin(annotation) is dict and typing.get_args(annotation)[1:] == (torch.Tensor,):
            kinds[name] = "tensors"
    return kinds


# ----------------------------------------------------------------- encode
def encode(message: Message) -> bytes:
    """``message`` as safetensors bytes: tensor fields as tensors, the rest as JSON metadata."""
    schema = type(message)
    kinds = _tensor_fields(schema)
    tensors: dict[str, torch.Tensor] = {}
    for name, kind in kinds.items():
        value = getattr(message, name)
        parts = value.to_tensors() if kind == "batch" else value
        tensors.update({f"{name}.{key}": t for key, t in parts.items()})
    metadata = {JSON_KEY: message.model_dump_json(exclude=set(kinds)), MESSAGE_KEY: schema.__name__}
    return st_save(_unshared(tensors), metadata=metadata)


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors that share no storage (safetensors refuses shared memory).

    Batches often reuse one tensor for two fields (e.g. rewards as advantages); copying the
    second occurrence costs little next to the transfer itself.
    """
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().to("cpu").contiguous()
        ptr = tensor.untyped_storage().data_ptr()
        if tensor.numel() and ptr in seen:
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        out[name] = tensor
    return out


# ----------------------------------------------------------------- decode
def decode[M: Message](data: bytes, schema: type[M]) -> M:
    """Parse and validate ``data`` as a ``schema`` message; every failure names its cause."""
    metadata = _metadata(data)
    sent = metadata.get(MESSAGE_KEY)
    if sent is None:
        raise RequestError(f"not an Arctic message: the safetensors metadata has no {MESSAGE_KEY!r} key")
    if sent != schema.__name__:
        raise RequestError(f"the body holds a {sent!r} message but this operation takes a {schema.__name__}")
    fields = _json_fields(metadata[JSON_KEY], schema)
    fields.update(_tensor_values(_tensors(data), schema))
    try:
        return schema.model_validate(fields)
    except ValidationError as exc:
        raise RequestError(format_validation_error(exc, f"message ({schema.__name__})", schema)) from None


def _metadata(data: bytes) -> dict[str, str]:
    """The safetensors header's ``__metadata__``, read by hand: the library only returns tensors."""
    if len(data) < 8:
        raise RequestError(f"truncated body: {len(data)} bytes, but a safetensors message starts with an 8-byte "
                           "header length")
    (size,) = struct.unpack("<Q", data[:8])
    if size > _MAX_HEADER:
        raise RequestError(f"not a safetensors message: header length {size} is absurd (garbage or wrong content "
                           "type?)")
    if 8 + size > len(data):
        raise RequestError(f"truncated body: the safetensors header needs {size} bytes but only {len(data) - 8} follow")
    header = _parse_json(data[8 : 8 + size], "the safetensors header")
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or not isinstance(metadata.get(JSON_KEY), str):
        raise RequestError(f"not an Arctic message: the safetensors metadata has no {JSON_KEY!r} key")
    return metadata


def _parse_json(text: str | bytes, what: str) -> Any:
    """``json.loads`` of a part of the body, any failure a :class:`RequestError` naming ``what``."""
    try:
        return json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(f"malformed body: {what} is not JSON ({exc})") from None
    except RecursionError:  # the parser recurses once per level: a thousand "[" exceed Python's limit
        raise RequestError(f"malformed body: {what} nests JSON arrays or objects too deeply") from None


def _json_fields(text: str, schema: type[Message]) -> dict[str, Any]:
    fields = _parse_json(text, f"the {JSON_KEY!r} metadata of the {schema.__name__}")
    if not isinstance(fields, dict):
        raise RequestError(f"the {JSON_KEY!r} metadata of the {schema.__name__} must be a JSON object")
    clash = sorted(set(fields) & set(_tensor_fields(schema)))
    if clash:
        raise RequestError(f"field(s) {clash} of the {schema.__name__} must travel as tensors, not JSON")
    return fields


def _tensors(data: bytes) -> dict[str, torch.Tensor]:
    try:
        return st_load(data)
    except SafetensorError as exc:
        raise RequestError(f"malformed or truncated safetensors body: {exc}") from None


def _tensor_values(tensors: dict[str, torch.Tensor], schema: type[Message]) -> dict[str, Any]:
    """Group ``<field>.<name>`` tensors by field; batches are validated by ``from_tensors``."""
    kinds = _tensor_fields(schema)
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        field, _, name = key.partition(".")
        if field not in kinds or not name:
            expected = [f"{k}.*" for k in kinds] or "none"
            raise RequestError(f"unexpected tensor {key!r} in a {schema.__name__}; tensors it takes: {expected}")
        groups.setdefault(field, {})[name] = tensor
    values: dict[str, Any] = {}
    for field, kind in kinds.items():
        if kind == "batch" and field in groups:
            values[field] = RolloutBatch.from_tensors(groups[field])  # BatchError names the bad field
        elif kind == "tensors":
            values[field] = groups.get(field, {})
    return values


# ----------------------------------------------------------------- per operation
def _schemas(op: str) -> tuple[type[Message], type[Result]]:
    if op not in OPS:
        raise RequestError(f"unknown operation {op!r}; operations: {sorted(OPS)}")
    return OPS[op]


def encode_request(op: str, request: Message) -> bytes:
    """``request`` encoded for ``op``, refused here if it is not that operation's request type."""
    expected = _schemas(op)[0]
    if not isinstance(request, expected):
        raise RequestError(f"operation {op!r} takes a {expected.__name__}, got {type(request).__name__}")
    return encode(request)


def decode_request(op: str, data: bytes) -> Message:
    return decode(data, _schemas(op)[0])


def decode_result(op: str, data: bytes) -> Result:
    return decode(data, _schemas(op)[1])

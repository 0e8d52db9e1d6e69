"""Framework settings in Arctic's terms, where frameworks speak the same dialect.

verl and SkyRL both describe sampling with vLLM's parameter names, and both adapters start a
backend from the framework's settings with the user's ``arctic.config`` laid over them.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from arctic_core.config import SamplingParams, format_validation_error
from arctic_core.errors import RequestError

# vLLM's names that have an Arctic meaning.
VLLM_SAMPLING_KEYS = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens", "seed",
                      "stop_token_ids", "ignore_eos"}


def overlay(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` laid over it, nested mappings merged key by key."""
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = (overlay(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict)
                       else value)
    return merged


def vllm_sampling_params(request: dict[str, Any], max_tokens: int) -> SamplingParams:
    """One sample (``n=1``) of a request in vLLM's names (``top_k=-1``: no top-k; ``max_tokens``
    when the request names none); a value out of range or of the wrong type is a RequestError
    naming it."""
    top_k = request.get("top_k")
    fields = {
        "n": 1, "temperature": request.get("temperature", 1.0), "top_p": request.get("top_p", 1.0),
        "top_k": 0 if isinstance(top_k, int) and top_k < 0 else top_k or 0, "min_p": request.get("min_p", 0.0),
        "repetition_penalty": request.get("repetition_penalty", 1.0),
        "max_tokens": request.get("max_tokens") or max_tokens, "seed": request.get("seed"),
        "stop_token_ids": request.get("stop_token_ids") or [], "ignore_eos": request.get("ignore_eos") or False,
    }
    try:
        return SamplingParams.model_validate(fields)
    except ValidationError as exc:
        raise RequestError(format_validation_error(exc, "sampling params", SamplingParams)) from None


def finish_reason(tokens: list[int], max_tokens: int, stops: set[int] | list[int]) -> str:
    """vLLM's finish reason for a sample: "length" when it used ``max_tokens`` without ending in
    one of ``stops`` (the ids that end a sample), "stop" otherwise."""
    return "length" if len(tokens) >= max_tokens and tokens[-1] not in stops else "stop"

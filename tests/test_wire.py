"""The wire format: every protocol message round-trips exactly; bad bytes get errors naming the problem."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save as st_save

from arctic_core import wire
from arctic_core.batch import RolloutBatch
from arctic_core.errors import BatchError, RequestError
from helpers import batch_tensors, wire_body
from arctic_core.protocol import (
    CheckpointRequest,
    Empty,
    EnginesRequest,
    FwdBwdRequest,
    GenerateRequest,
    GenerateResult,
    LogProbsRequest,
    LogProbsResult,
    Message,
    OPS,
    Result,
    StatusResult,
    StepRequest,
    SyncWeightsResult,
)


def full_batch() -> RolloutBatch:
    """Every optional field set, one tensor reused for two fields, an empty response, extras."""
    batch = RolloutBatch.from_lists([[1, 2, 3], [4, 5]], [[6, 7], [], [8, 9, 10]], [0, 0, 1])
    rewards = torch.tensor([1.0, -0.5, 0.25])
    token = -torch.rand(3, 3, dtype=torch.float64)
    return batch.replace(
        old_logprobs=token, ref_logprobs=token * 2, sampling_logprobs=token.float(),
        advantages=rewards, rewards=rewards,  # shared storage: safetensors alone would refuse it
        policy_version=torch.tensor([3, 3, 4]), extras={"values": torch.randn(3, 3, dtype=torch.bfloat16)},
    )


def samples() -> dict[str, tuple[Message, Result]]:
    batch = full_batch()
    outputs = {"logprobs": torch.randn(3, 3), "entropy": torch.rand(3, 3, dtype=torch.bfloat16)}
    status = StatusResult(policy_version=2, step=5, info={"config": {"a": [1, 2]}}, metrics={"seconds": 0.5})
    return {
        "generate": (
            GenerateRequest(prompts=[[1, 2], [3]],
                            params={"n": 4, "temperature": 0.7, "stop_token_ids": [2], "seed": 9}),
            GenerateResult(batch=batch, metrics={"generated_tokens": 5.0, "seconds": 0.1}),
        ),
        "log_probs": (
            LogProbsRequest(batch=batch, model="reference", processors=["logprobs", "entropy"], temperature=0.7),
            LogProbsResult(outputs=outputs, metrics={"tokens": 12.0}),
        ),
        "fwd_bwd": (
            FwdBwdRequest(batch=batch, loss=[{"name": "ppo", "clip_low": 0.2}, {"name": "kl", "weight": 1e-3}],
                          scale=0.5, max_response_len=7),
            Result(metrics={"loss": 1.25, "ppo/clipfrac": 0.0}),
        ),
        "step": (StepRequest(lr=1e-4), Result(metrics={"grad_norm": 3.5, "step": 1.0})),
        "sync_weights": (Empty(), SyncWeightsResult(policy_version=3, metrics={"bytes": 10.0})),
        "save_checkpoint": (CheckpointRequest(path="/tmp/ckpt", export_hf=True), status),
        "load_checkpoint": (CheckpointRequest(path="/tmp/ckpt"), status),
        "sleep": (EnginesRequest(engines=["sampler", "trainer"]), Result()),
        "wake": (EnginesRequest(), Result()),
        "status": (Empty(), status),
        "shutdown": (Empty(), Result()),
    }


def assert_same(a: Message, b: Message) -> None:
    """Equal types, equal plain fields, bit-equal tensors of the same dtype."""
    assert type(a) is type(b)
    kinds = wire._tensor_fields(type(a))
    assert a.model_dump(exclude=set(kinds)) == b.model_dump(exclude=set(kinds))
    for name, kind in kinds.items():
        x, y = getattr(a, name), getattr(b, name)
        x, y = (x.to_tensors(), y.to_tensors()) if kind == "batch" else (x, y)
        assert x.keys() == y.keys()
        for key in x:
            assert x[key].dtype == y[key].dtype and torch.equal(x[key], y[key]), f"{name}.{key}"


def test_samples_cover_every_operation():
    assert samples().keys() == OPS.keys()


@pytest.mark.parametrize("op", sorted(OPS))
def test_every_request_and_result_round_trips_exactly(op):
    request, result = samples()[op]
    assert isinstance(request, OPS[op][0]) and isinstance(result, OPS[op][1])
    assert_same(wire.decode_request(op, wire.encode(request)), request)
    assert_same(wire.decode_result(op, wire.encode(result)), result)


def test_tensors_travel_as_safetensors_and_the_rest_as_json_metadata():
    request, _ = samples()["fwd_bwd"]
    data = wire.encode(request)
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    assert header["__metadata__"][wire.MESSAGE_KEY] == "FwdBwdRequest"
    loss = json.loads(header["__metadata__"][wire.JSON_KEY])["loss"]
    assert loss[0] == {"name": "ppo", "weight": 1.0, "clip_low": 0.2}
    names = set(header) - {"__metadata__"}
    assert {"batch.prompt_ids", "batch.advantages", "batch.rewards", "batch.extras.values"} <= names
    assert all(name.startswith("batch.") for name in names)
    assert b"pickle" not in data and not data.startswith(b"\x80")  # not a pickle stream


def test_non_finite_numbers_travel_as_strict_json():
    result = Result(metrics={"grad_norm": float("nan"), "peak": float("inf"), "low": float("-inf"), "lr": 1e-3})
    data = wire.encode(result)
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    fields = json.loads(header["__metadata__"][wire.JSON_KEY], parse_constant=refuse)
    assert fields["metrics"] == {"grad_norm": "NaN", "peak": "Infinity", "low": "-Infinity", "lr": 1e-3}
    back = wire.decode(data, Result).metrics
    assert math.isnan(back["grad_norm"]) and back["peak"] == float("inf") and back["low"] == float("-inf")


@pytest.mark.parametrize(
    ("data", "error", "match"),
    [
        (b"", RequestError, "truncated body: 0 bytes"),
        (b"garbage", RequestError, "truncated body: 7 bytes"),
        (b"\xff" * 64, RequestError, "header length .* is absurd"),
        (b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}", RequestError, "header is not JSON"),
        (b"\x02\x00\x00\x00\x00\x00\x00\x00{}", RequestError, "has no 'arctic' key"),
        (wire_body({}, {"prompts": [[1]]}, "FwdBwdRequest"), RequestError,
         "holds a 'FwdBwdRequest' message but this operation takes a GenerateRequest"),
        (wire_body({}, {"prompts": [["a"]]}, "GenerateRequest"), RequestError,
         "prompts.0.0: Input should be a valid integer"),
        # Token ids are strict ints: lax ones would take true as 1, "2" and 2.0 as 2.
        (wire_body({}, {"prompts": [[1, True]]}, "GenerateRequest"), RequestError,
         "prompts.0.1: Input should be a valid integer"),
        (wire_body({}, {"prompts": [[1], ["2"]]}, "GenerateRequest"), RequestError,
         "prompts.1.0: Input should be a valid integer"),
        (wire_body({}, {"prompts": [[2.0]]}, "GenerateRequest"), RequestError,
         "prompts.0.0: Input should be a valid integer"),
        (wire_body({}, {"prompts": [[-1]]}, "GenerateRequest"), RequestError,
         "prompts.0.0: Input should be greater than or equal to 0"),
        (wire_body({}, {"prompts": [[1]], "params": {"stop_token_ids": [False]}}, "GenerateRequest"), RequestError,
         "params.stop_token_ids.0: Input should be a valid integer"),
        (wire_body({}, {}, "GenerateRequest"), RequestError, "prompts: Field required"),
        (wire_body({"batch.prompt_ids": torch.ones(1, 1)}, {"prompts": [[1]]}, "GenerateRequest"), RequestError,
         "unexpected tensor 'batch.prompt_ids' in a GenerateRequest"),
        (wire_body({}, {"prompts": [[1]], "parms": {}}, "GenerateRequest"), RequestError,
         r"parms: unknown key \(did you mean 'params'\?\); valid keys: params, prompts"),
    ],
)
def test_bad_generate_bodies_name_the_problem(data, error, match):
    with pytest.raises(error, match=match):
        wire.decode_request("generate", data)


@pytest.mark.parametrize(
    ("tensors", "fields", "error", "match"),
    [
        (batch_tensors(), {}, RequestError, "loss: Field required"),
        ({}, {"loss": [{"name": "ppo"}]}, RequestError, "batch: Field required"),
        ({k: v for k, v in batch_tensors().items() if k != "batch.prompt_index"}, {"loss": [{"name": "ppo"}]},
         BatchError, r"missing required batch field\(s\) \['prompt_index'\]"),
        (batch_tensors(response_ids=torch.ones(1, 2)), {"loss": [{"name": "ppo"}]}, BatchError,
         r"response_ids must hold integers \(int64 or int32\), got dtype torch.float32"),
        (batch_tensors(advantages=torch.ones(1, 5)), {"loss": [{"name": "ppo"}]}, BatchError,
         r"advantages must be \[B\] or \[B, Lr\]"),
        (batch_tensors(old_logprobs=torch.ones(1, 2, dtype=torch.int64)), {"loss": [{"name": "ppo"}]}, BatchError,
         "old_logprobs must be a float16, bfloat16, float32 or float64 tensor"),
        ({**batch_tensors(), "batch.bogus": torch.ones(1)}, {"loss": [{"name": "ppo"}]}, BatchError,
         r"unknown batch field\(s\) \['bogus'\]"),
        (batch_tensors(), {"loss": [{"name": "ppo"}], "batch": {}}, RequestError,
         r"field\(s\) \['batch'\] .* must travel as tensors"),
    ],
)
def test_bad_fwd_bwd_bodies_name_the_problem(tensors, fields, error, match):
    with pytest.raises(error, match=match):
        wire.decode_request("fwd_bwd", wire_body(tensors, fields, "FwdBwdRequest"))


def test_json_nested_deeper_than_the_parser_recurses_is_a_malformed_body():
    deep = "[" * 100_000 + "]" * 100_000
    header = deep.encode()
    with pytest.raises(RequestError,
                       match="malformed body: the safetensors header nests JSON arrays or objects too deeply"):
        wire.decode_request("generate", len(header).to_bytes(8, "little") + header)
    body = st_save({}, metadata={wire.JSON_KEY: deep, wire.MESSAGE_KEY: "GenerateRequest"})
    with pytest.raises(RequestError, match="malformed body: the 'arctic' metadata of the GenerateRequest nests JSON"):
        wire.decode_request("generate", body)


def test_every_truncation_of_a_message_is_refused():
    data = wire.encode(samples()["log_probs"][0])
    for cut in [*range(0, 16), len(data) // 2, len(data) - 1]:
        with pytest.raises(RequestError, match="truncated|not JSON|malformed"):
            wire.decode_request("log_probs", data[:cut])


def test_unknown_operation_is_refused_by_name():
    with pytest.raises(RequestError, match="unknown operation 'train'"):
        wire.decode_request("train", b"")

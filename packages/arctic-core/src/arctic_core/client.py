"""The thin client a framework talks to: five calls plus lifecycle, over any transport.

:class:`ArcticClient` blocks; :class:`AsyncArcticClient` has the same methods as coroutines.
Both build the same protocol requests (validated here, before anything is sent) and hand them to
the transport. Gradients from ``fwd_bwd`` add up across calls until ``step``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from arctic_core.batch import RolloutBatch
from arctic_core.config import ArcticConfig, ConfigSource, LossTermConfig, SamplingParams, format_validation_error
from arctic_core.errors import RequestError
from arctic_core.protocol import (
    CheckpointRequest,
    Empty,
    EngineName,
    EnginesRequest,
    FwdBwdRequest,
    GenerateRequest,
    LogProbsRequest,
    Message,
    StepRequest,
)
from arctic_core.transports import Transport

LossSpec = str | dict[str, Any] | LossTermConfig
Prompts = Sequence[Sequence[int]]


def _request[M: BaseModel](schema: type[M], **fields: Any) -> M:
    try:
        return schema.model_validate(fields)
    except ValidationError as exc:
        raise RequestError(format_validation_error(exc, f"request ({schema.__name__})", schema)) from None


def _folder(path: str | os.PathLike[str]) -> str:
    """A checkpoint folder's path as text; anything else (``save_checkpoint(5)`` meant as a step
    number) is refused rather than turned into a folder named "5"."""
    if not isinstance(path, (str, os.PathLike)):
        raise RequestError(f"path: a checkpoint folder's path (str or os.PathLike), got {type(path).__name__} {path!r}")
    return os.fspath(path)


def _token_ids(prompt: Sequence[int], index: int) -> list[Any]:
    """A prompt's token ids as a list of Python scalars (a tensor's or an array's through ``tolist()``,
    numpy or torch scalars through ``item()``), which the request then checks as strict ints: an
    integer scalar passes, a bool, float or string is refused."""
    if isinstance(prompt, (str, bytes)):
        raise RequestError(f"prompts[{index}] is text: generate() takes token ids (tokenize first, e.g. "
                           "tokenizer(text).input_ids)")
    if isinstance(prompt, int):
        raise RequestError("prompts is a list of token ids: generate() takes a list of prompts, each a list of "
                           "token ids (one prompt: [[...]])")
    ids = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
    return [t.item() if hasattr(t, "item") else t for t in ids]


def _loss_terms(loss: LossSpec | Sequence[LossSpec]) -> list[Any]:
    if isinstance(loss, (str, dict, LossTermConfig)):
        items = [loss]
    elif isinstance(loss, Sequence):
        items = list(loss)
    else:
        raise RequestError(f"loss must be a term (a name, a dict or a LossTermConfig) or a list of them, "
                           f"got {type(loss).__name__}")
    return [{"name": item} if isinstance(item, str) else item for item in items]


class _Calls:
    """The operations; ``_call`` decides whether they block or return awaitables."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self._shut_down = False  # set by a successful shutdown(): leaving a `with` block must not repeat it

    def _call(self, op: str, request: Message) -> Any:
        raise NotImplementedError

    def generate(self, prompts: Prompts, params: SamplingParams | dict[str, Any] | None = None, **kwargs: Any) -> Any:
        """Sample ``params.n`` responses per prompt -> ``GenerateResult`` (``.batch`` is a RolloutBatch)."""
        params = _request(SamplingParams, **{**_as_dict(params), **kwargs})
        ids = [_token_ids(p, i) for i, p in enumerate(prompts)]
        return self._call("generate", _request(GenerateRequest, prompts=ids, params=params))

    def log_probs(
        self,
        batch: RolloutBatch,
        model: str = "policy",
        processors: str | Sequence[str] = ("logprobs",),
        temperature: float = 1.0,
    ) -> Any:
        """Per-token outputs (``[B, Lr]`` each) of the policy or the reference model -> ``LogProbsResult``;
        ``processors`` is one name or several."""
        names = [processors] if isinstance(processors, str) else list(processors)  # a str is a Sequence too
        return self._call(
            "log_probs",
            _request(LogProbsRequest, batch=batch, model=model, processors=names, temperature=temperature),
        )

    def fwd_bwd(
        self,
        batch: RolloutBatch,
        loss: LossSpec | Sequence[LossSpec],
        temperature: float = 1.0,
        scale: float = 1.0,
        max_response_len: int | None = None,
        max_staleness: int | None = None,
    ) -> Any:
        """Forward + backward of the loss terms; gradients accumulate until :meth:`step`.
        ``max_staleness``: tokens drawn more than this many weight syncs ago are left out of the loss
        (the result's metrics say how many, and the staleness of those kept)."""
        return self._call(
            "fwd_bwd",
            _request(
                FwdBwdRequest,
                batch=batch,
                loss=_loss_terms(loss),
                temperature=temperature,
                scale=scale,
                max_response_len=max_response_len,
                max_staleness=max_staleness,
            ),
        )

    def step(self, lr: float | None = None) -> Any:
        """Clip, apply and zero the accumulated gradients; advance the LR schedule (``lr``: use this
        learning rate for the step instead, for a framework that drives its own schedule)."""
        return self._call("step", _request(StepRequest, lr=lr))

    def sync_weights(self) -> Any:
        """Push the trainer's weights to the samplers; returns the new policy version."""
        return self._call("sync_weights", Empty())

    def save_checkpoint(self, path: str | os.PathLike[str], export_hf: bool = False,
                        keep_last: int | None = None) -> Any:
        """Atomically save trainer state (with ``export_hf``, also a Hugging Face folder at ``path/hf``;
        with ``keep_last``, then delete all but the newest k checkpoints beside ``path``)."""
        request = _request(CheckpointRequest, path=_folder(path), export_hf=export_hf, keep_last=keep_last)
        return self._call("save_checkpoint", request)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> Any:
        return self._call("load_checkpoint", _request(CheckpointRequest, path=_folder(path)))

    def sleep(self, engines: Sequence[EngineName] | None = None) -> Any:
        """Free the named engines' device memory (all engines when None)."""
        return self._call("sleep", _request(EnginesRequest, engines=engines))

    def wake(self, engines: Sequence[EngineName] | None = None) -> Any:
        return self._call("wake", _request(EnginesRequest, engines=engines))

    def status(self) -> Any:
        """Policy version and step -> ``StatusResult``; ``info["config"]`` is the server's config and
        ``info["load"]`` (from servers that report it) what runs now: ``calls`` running and waiting,
        ``generate_calls`` in flight, and the ``sampler``'s own load when it counts one (samples
        ``running``, ``waiting``, ``preempted`` so far, ``kv_used_blocks`` of ``kv_blocks``). Never
        waits behind other calls."""
        return self._call("status", Empty())

    def shutdown(self) -> Any:
        return self._call("shutdown", Empty())


def _as_dict(params: SamplingParams | dict[str, Any] | None) -> dict[str, Any]:
    if params is None:
        return {}
    return params.model_dump(exclude_unset=True) if isinstance(params, SamplingParams) else dict(params)


class ArcticClient(_Calls):
    """Blocking client. ``ArcticClient.in_process(config)`` embeds a server in this process."""

    def _call(self, op: str, request: Message) -> Any:
        return self.transport.call(op, request)

    @classmethod
    def in_process(cls, config: ConfigSource) -> ArcticClient:
        return cls(_in_process_transport(config))

    @classmethod
    def http(cls, url: str, token: str | None = None, timeout: float | None = 600.0) -> ArcticClient:
        """A client of the ``arctic-rl serve`` server at ``url``; ``token`` defaults to ``$ARCTIC_RL_TOKEN``."""
        from arctic_core.transports.http import HttpTransport

        return cls(HttpTransport(url, token=token, timeout=timeout))

    @classmethod
    def ray(cls, config: ConfigSource | None = None, *, name: str = "arctic-server",
            address: str | None = None, num_gpus: float = 0.0, num_cpus: float = 1.0) -> ArcticClient:
        """With ``config``: start the server as the Ray actor ``name`` (with those resources);
        without: connect to it."""
        return cls(_ray_transport(config, name, address, num_gpus, num_cpus))

    def shutdown(self) -> Any:
        """Shut the engines down; the server refuses every later call."""
        result = super().shutdown()
        self._shut_down = True
        return result

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> ArcticClient:
        return self

    def __exit__(self, *exc: object) -> None:
        # A remote server is shared: leaving only closes the connection.
        if _owns_server(self.transport) and not self._shut_down:
            self.shutdown()
        self.close()


class AsyncArcticClient(_Calls):
    """The same calls as coroutines: ``await client.generate(...)``."""

    def _call(self, op: str, request: Message) -> Any:
        return self.transport.acall(op, request)

    @classmethod
    def in_process(cls, config: ConfigSource) -> AsyncArcticClient:
        return cls(_in_process_transport(config))

    @classmethod
    def http(cls, url: str, token: str | None = None, timeout: float | None = 600.0) -> AsyncArcticClient:
        """An async client of the server at ``url``; calls are truly async (httpx.AsyncClient)."""
        from arctic_core.transports.http import HttpTransport

        return cls(HttpTransport(url, token=token, timeout=timeout))

    @classmethod
    def ray(cls, config: ConfigSource | None = None, *, name: str = "arctic-server",
            address: str | None = None, num_gpus: float = 0.0, num_cpus: float = 1.0) -> AsyncArcticClient:
        """As :meth:`ArcticClient.ray`; calls await the actor's results."""
        return cls(_ray_transport(config, name, address, num_gpus, num_cpus))

    async def shutdown(self) -> Any:
        """Shut the engines down; the server refuses every later call."""
        result = await super().shutdown()
        self._shut_down = True
        return result

    async def aclose(self) -> None:
        aclose = getattr(self.transport, "aclose", None)
        if aclose is not None:
            await aclose()
        else:
            self.transport.close()

    async def __aenter__(self) -> AsyncArcticClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if _owns_server(self.transport) and not self._shut_down:
            await self.shutdown()
        await self.aclose()


def _owns_server(transport: Transport) -> bool:
    """Whether closing the client should shut the server down (an embedded one, not a remote one)."""
    return getattr(transport, "owns_server", True)


def _ray_transport(config: ConfigSource | None, name: str, address: str | None,
                   num_gpus: float, num_cpus: float) -> Transport:
    from arctic_core.transports.ray import RayTransport

    if config is None:
        return RayTransport.connect(name, address)
    return RayTransport.start(ArcticConfig.of(config), name, address, num_gpus, num_cpus)


def _in_process_transport(config: ConfigSource) -> Transport:
    from arctic_core.serving.server import ArcticServer
    from arctic_core.transports.inprocess import InProcessTransport

    return InProcessTransport(ArcticServer(ArcticConfig.of(config)))

"""PRIME-RL's inference server, answered by Arctic's sampler.

PRIME-RL's environment servers sample token-in/token-out through ``POST /inference/v1/generate``
(one sample per call; this front regroups the calls of one prompt into one Arctic ``generate`` so the
prompt is prefilled and read once per group); evaluations use ``POST /v1/chat/completions``. Its
orchestrator checks ``/health`` and ``/v1/models``, polls ``/metrics``, and around each new policy
calls ``/pause``, ``/update_weights`` and ``/resume``. Arctic's trainer has already pushed the new
weights to the sampler in memory when it announces a step, so ``/update_weights`` only checks that
the step it names is one Arctic trained. Log-probs are the sampler's own, after temperature, as
PRIME-RL's importance ratio expects (vLLM's ``processed_logprobs``).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field

from arctic_core.adapters import refusals as reasons
from arctic_core.adapters.sampling import GroupedSampler
from arctic_core.adapters.translation import VLLM_SAMPLING_KEYS, finish_reason, vllm_sampling_params
from arctic_core.client import AsyncArcticClient
from arctic_core.config import SamplingParams
from arctic_core.errors import ArcticError, error_answer
from arctic_core.hf import generation_config
from arctic_core.serving.http import ApiError, bearer_check, error_response

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 2.0
"""How long a ``/metrics`` scrape waits for the server's load (PRIME-RL gives a scrape 5 s)."""

# vLLM sampling keys whose values Arctic cannot honour, with the value that means "off".
UNSERVED_SAMPLING = {"n": 1, "stop": None, "min_tokens": 0, "presence_penalty": 0.0,
                     "frequency_penalty": 0.0, "logit_bias": None, "prompt_logprobs": None, "bad_words": None,
                     "allowed_token_ids": None, "structured_outputs": None, "guided_decoding": None,
                     "routed_experts_prompt_start": None, "truncate_prompt_tokens": None}
# Keys that change nothing here: the sampled token's log-prob and the token ids always come back.
IGNORED_SAMPLING = {"logprobs", "skip_special_tokens", "return_token_ids", "cache_salt", "detokenize",
                    "spaces_between_special_tokens", "include_stop_str_in_output", "output_kind", "extra_args"}


# generation_config.json settings that vLLM's chat server takes as the defaults of a request naming
# none (its max_new_tokens it does not: a sample runs up to the context).
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass
class FrontSettings:
    model_name: str
    max_model_len: int
    eos_token_ids: set[int]
    token: str | None = None
    group_quiet_s: float = 0.2
    group_max_wait_s: float = 5.0
    chat_defaults: dict[str, Any] = field(default_factory=dict)
    """Sampling settings a chat request leaves out, from the model's generation config (as vLLM's)."""


def chat_defaults(model: str) -> dict[str, Any]:
    """The sampling settings the model's ``generation_config.json`` sets (none without one), which
    vLLM's chat server samples with."""
    config = generation_config(model)
    given = config.to_diff_dict() if config is not None else {}
    return {key: given[key] for key in GENERATION_DEFAULTS if given.get(key) is not None}


@dataclass
class FrontState:
    """The pause gate, the trained step, and the requests this front holds (``/metrics`` reports
    them where the server reports no sampler load)."""

    trained_step: Callable[[], int]
    running: int = 0
    waiting: int = 0
    unpaused: asyncio.Event = field(default_factory=asyncio.Event)


class FrontMetrics:
    """``/metrics``: what vLLM reports of its load, under vLLM's names and types (label ``engine``),
    in a registry of the app's own. PRIME-RL's orchestrator polls it (every 5 s) for its dashboards
    and its concurrency control, which trims the rollouts in flight when the KV cache fills and cuts
    them on preemptions or a lasting queue: so the numbers are the sampler's own (samples running,
    waiting, preempted, KV blocks used), read from the server's load at each scrape. A server that
    reports none (an older one, a sampler that counts nothing) leaves this front's own counts."""

    def __init__(self, state: FrontState) -> None:
        self.state = state
        self.sampler: dict[str, int] = {}  # the sampler's load of this scrape, set by ``render``
        self.registry = CollectorRegistry()
        self.registry.register(self)  # ``collect`` below: values computed at each scrape
        self.served = Counter("arctic:requests_served", "Generate and chat requests answered.", registry=self.registry)

    def collect(self) -> Iterator[Metric]:
        sampler, state = self.sampler, self.state
        # Requests held while paused wait too, as vLLM's own (new requests queue in its scheduler).
        running, waiting = (sampler["running"], sampler["waiting"] + state.waiting) if sampler \
            else (state.running, state.waiting)
        used = sampler["kv_used_blocks"] / max(sampler["kv_blocks"], 1) if sampler else 0.0
        for name, about, value in (
            ("vllm:num_requests_running", "Samples the sampler decodes now.", running),
            ("vllm:num_requests_waiting", "Samples waiting to start (in line, being prefilled, or held while "
                                          "paused).", waiting),
            ("vllm:kv_cache_usage_perc", "Share of the KV cache's blocks in use (0 to 1).", used)):
            gauge = GaugeMetricFamily(name, about, labels=["engine"])
            gauge.add_metric(["0"], value)
            yield gauge
        # A counter, as vLLM's: PRIME-RL reads its increase between two polls (the ``_total`` sample).
        preempted = CounterMetricFamily("vllm:num_preemptions", "Samples preempted so far (their KV blocks "
                                        "taken back, to be recomputed).", labels=["engine"])
        preempted.add_metric(["0"], sampler.get("preempted", 0))
        yield preempted

    def render(self, sampler: dict[str, int]) -> bytes:
        """The metrics with ``sampler``, the sampler's load (``{}``: none reported)."""
        self.sampler = sampler
        return generate_latest(self.registry)


class GenerateBody(BaseModel):
    """vLLM's token-in generate request as PRIME-RL's renderer client sends it."""

    model_config = ConfigDict(extra="allow")
    model: str
    token_ids: list[int]
    sampling_params: dict[str, Any] = {}
    cache_salt: str | None = None
    priority: int = 0
    features: Any = None
    stream: bool = False


class ChatBody(BaseModel):
    """The chat-only fields; the sampling settings stay in the extras and are checked as the
    generate route's."""

    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[dict[str, Any]]
    stream: bool = False
    n: Annotated[int, Field(ge=1, le=4096)] = 1
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0)] | None = None
    chat_template_kwargs: dict[str, Any] = {}


def sampling_params(body: dict[str, Any], prompt_len: int, settings: FrontSettings) -> SamplingParams:
    """vLLM sampling parameters in Arctic's terms; anything Arctic would silently ignore is refused.
    The model's end-of-sequence ids (the tokenizer's and the generation config's) stop a sample
    besides the request's ``stop_token_ids`` unless ``ignore_eos``, as in vLLM."""
    max_model_len = settings.max_model_len
    for key, off in UNSERVED_SAMPLING.items():
        value = body.get(key)
        if value not in (None, off) and value != [] and value != {}:
            raise ApiError(400, "BadRequest", f"sampling_params.{key} = {value!r} is not supported by Arctic's sampler")
    known = set(UNSERVED_SAMPLING) | IGNORED_SAMPLING | VLLM_SAMPLING_KEYS
    if not isinstance(body.get("logprobs"), int | None) or (body.get("logprobs") or 0) > 1:
        raise ApiError(400, "BadRequest", f"sampling_params.logprobs = {body['logprobs']!r}: Arctic returns the "
                                          "sampled token's log-prob only (logprobs = 1)")
    unknown = sorted(set(body) - known)
    if unknown:
        raise ApiError(400, "BadRequest", f"unknown sampling_params {unknown}")
    room = max_model_len - prompt_len
    if room <= 0:
        raise ApiError(400, "BadRequest", f"the prompt has {prompt_len} tokens; the model's context is {max_model_len}")
    # PRIME-RL's server refuses only a prompt past the context: a sample whose max_tokens would
    # overrun it stops at the context, finish_reason "length" (no max_tokens: up to the context).
    params = vllm_sampling_params(body, room)
    eos = set() if params.ignore_eos else settings.eos_token_ids
    return params.model_copy(update={"max_tokens": min(params.max_tokens, room),
                                     "stop_token_ids": sorted(set(params.stop_token_ids) | eos)})


class Front:
    """What the routes share: the settings, the state, the metrics, and the sampler that turns
    single-sample calls into one Arctic ``generate`` per prompt group."""

    def __init__(self, connect: Callable[[], AsyncArcticClient], settings: FrontSettings,
                 trained_step: Callable[[], int], tokenizer: Any) -> None:
        self.settings, self.tokenizer = settings, tokenizer
        self.state = FrontState(trained_step)
        self.state.unpaused.set()
        self.metrics = FrontMetrics(self.state)
        self.sampler = GroupedSampler(connect, settings.group_quiet_s, settings.group_max_wait_s)
        self._connect = connect
        self._status_client: AsyncArcticClient | None = None

    async def sampler_load(self) -> dict[str, int]:
        """The sampler's load as the server's ``status`` reports it ({} when it reports none or does
        not answer in time). A client of its own: over HTTP, the sampling client's calls in flight
        are bounded, and a scrape must not wait for a slot behind generate calls; ``status`` itself
        never waits behind other calls on the server."""
        if self._status_client is None:
            self._status_client = self._connect()
        try:
            status = await asyncio.wait_for(self._status_client.status(), LOAD_TIMEOUT_S)
        except (ArcticError, TimeoutError):
            log.debug("the Arctic server's load could not be read", exc_info=True)
            return {}
        return status.info.get("load", {}).get("sampler") or {}

    def check_model(self, name: str) -> None:
        if name != self.settings.model_name:
            raise ApiError(404, "NotFound", f"model {name!r} is not served; this server serves "
                                            f"{self.settings.model_name!r}")

    async def sample(self, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[float], str]:
        """One sample of ``prompt``: its tokens, their log-probs and vLLM's finish reason."""
        state = self.state
        if not state.unpaused.is_set():  # a paused server holds new work until resume (mode=keep)
            state.waiting += 1
            try:
                await state.unpaused.wait()
            finally:
                state.waiting -= 1
        state.running += 1
        try:
            batch, row = await self.sampler.sample(prompt, params)
        finally:
            state.running -= 1
        self.metrics.served.inc()
        tokens = batch.response(row)
        logprobs = batch.sampling_logprobs[row, : len(tokens)].tolist()
        finished = finish_reason(tokens, params.max_tokens, params.stop_token_ids)
        return tokens, logprobs, finished


def create_front(connect: Callable[[], AsyncArcticClient], settings: FrontSettings, trained_step: Callable[[], int],
                 tokenizer: Any = None) -> FastAPI:
    """The app; ``connect`` makes the Arctic client (in the app's event loop), ``trained_step``
    says which weights the sampler serves, ``tokenizer`` renders chat requests (evaluations)."""
    app = FastAPI(title="Arctic RL for PRIME-RL", description=(__doc__ or "").replace("``", "`"))
    front = Front(connect, settings, trained_step, tokenizer)
    authorised = [Depends(bearer_check(settings.token, "VLLM_API_KEY"))]

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.error, exc.message)

    @app.exception_handler(ArcticError)
    async def _arctic_error(request: Request, exc: ArcticError) -> JSONResponse:
        return error_response(*error_answer("generate", exc))

    _add_sampling_routes(app, front, authorised)
    _add_orchestrator_routes(app, front, authorised)
    return app


def _add_sampling_routes(app: FastAPI, front: Front, authorised: list) -> None:
    """Token-in generate (rollouts) and chat completions (evaluations)."""
    settings = front.settings

    @app.post("/inference/v1/generate", dependencies=authorised)
    async def generate(body: GenerateBody) -> dict[str, Any]:
        front.check_model(body.model)
        if body.features is not None or body.stream:
            raise ApiError(400, "BadRequest", "multimodal features and streaming are not supported by Arctic's sampler")
        if not body.token_ids:
            raise ApiError(400, "BadRequest", "token_ids is empty")
        params = sampling_params(body.sampling_params, len(body.token_ids), settings)
        tokens, logprobs, finished = await front.sample(body.token_ids, params)
        return {"request_id": f"gen-{uuid.uuid4().hex}", "prompt_logprobs": None,
                "choices": [{"index": 0, "token_ids": tokens, "finish_reason": finished,
                             "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": lp}
                                                      for t, lp in zip(tokens, logprobs, strict=True)]}}],
                "usage": _usage(len(body.token_ids), len(tokens))}

    @app.post("/v1/chat/completions", dependencies=authorised)
    async def chat(body: ChatBody) -> dict[str, Any]:
        front.check_model(body.model)
        tokenizer = front.tokenizer
        if tokenizer is None or body.stream:
            raise ApiError(400, "BadRequest", "chat completions need the model's tokenizer and are not streamed")
        # What is left after the chat-only keys goes through the generate route's checks: a setting
        # Arctic cannot honour (stop strings, penalties, tools...) is refused by name, not dropped.
        extra = dict(body.model_extra or {})
        template = body.chat_template_kwargs
        if "reasoning_effort" in extra:  # a chat-template variable (gpt-oss's template reads it)
            template = {"reasoning_effort": extra.pop("reasoning_effort"), **template}
        if body.top_logprobs:
            raise ApiError(400, "BadRequest", "top_logprobs: Arctic returns the sampled token's log-prob only")
        if "max_completion_tokens" in extra:
            extra["max_tokens"] = extra.pop("max_completion_tokens")
        extra = {**settings.chat_defaults, **extra}
        prompt = tokenizer.apply_chat_template(body.messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=False, **template)
        params = sampling_params(extra, len(prompt), settings)
        results = await asyncio.gather(*(front.sample(prompt, params) for _ in range(body.n)))
        choices = [{"index": i, "finish_reason": finished,
                    "logprobs": _chat_logprobs(tokenizer, tokens, logprobs) if body.logprobs else None,
                    "message": {"role": "assistant", "content": tokenizer.decode(tokens, skip_special_tokens=True)}}
                   for i, (tokens, logprobs, finished) in enumerate(results)]
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": settings.model_name, "choices": choices,
                "usage": _usage(len(prompt) * body.n, sum(len(t) for t, _, _ in results))}


def _add_orchestrator_routes(app: FastAPI, front: Front, authorised: list) -> None:
    """What PRIME-RL's orchestrator calls around sampling: health, models, pause/resume, weight
    updates and metrics."""
    state, settings = front.state, front.settings

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/liveness")
    async def liveness() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=authorised)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "owned_by": "arctic-rl",
                                            "max_model_len": settings.max_model_len}]}

    @app.post("/pause", dependencies=authorised)
    async def pause() -> dict[str, str]:
        state.unpaused.clear()
        return {"status": "paused"}

    @app.post("/resume", dependencies=authorised)
    async def resume() -> dict[str, str]:
        state.unpaused.set()
        return {"status": "resumed"}

    @app.post("/update_weights", dependencies=authorised)
    async def update_weights(request: Request) -> dict[str, str]:
        weight_dir = (await request.json()).get("weight_dir")
        match = re.search(r"step_(\d+)/?$", str(weight_dir or ""))
        if match is None:
            raise ApiError(400, "BadRequest", f"weight_dir {weight_dir!r} is not a broadcasts/step_N folder; "
                                              "Arctic serves the weights its own trainer announces")
        step, trained = int(match.group(1)), state.trained_step()
        if step > trained:
            raise ApiError(409, "Conflict", f"weights of step {step} were not trained by Arctic (its trainer has "
                                            f"announced step {trained}); is another trainer writing {weight_dir}?")
        return {"status": "ok"}

    @app.post("/init_broadcaster", dependencies=authorised)
    async def init_broadcaster() -> JSONResponse:
        return error_response(404, "NotFound",
                              "Arctic syncs the sampler itself; set weight_broadcast.type = 'filesystem'")

    @app.post("/load_lora_adapter", dependencies=authorised)
    async def load_lora_adapter() -> JSONResponse:
        return error_response(400, "BadRequest", f"{reasons.FULL_WEIGHTS}: LoRA adapters are not served")

    @app.get("/metrics", dependencies=authorised)
    async def metrics() -> Response:
        return Response(front.metrics.render(await front.sampler_load()), media_type=CONTENT_TYPE_LATEST)


def _chat_logprobs(tokenizer: Any, tokens: list[int], logprobs: list[float]) -> dict[str, Any]:
    """OpenAI's chat ``logprobs``: each sampled token's text and log-prob (no alternatives)."""
    return {"content": [{"token": tokenizer.decode([t]), "logprob": lp, "top_logprobs": []}
                        for t, lp in zip(tokens, logprobs, strict=True)]}


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

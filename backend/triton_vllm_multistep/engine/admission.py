"""Requests from submission to admission, for the engine loop: vLLM's request objects built from the
stub's EngineRequest, prepared off the engine thread, and no abort lost on the way.

Owns building a request's SamplingParams and LoRARequest from its plain values (`sampling_params`,
`lora_request`: the engine's side of engine/events.EngineRequest), handing requests that need it to
their preparation threads (image prompts decoded and processed: engine/multimodal.py; constraints
built: engine/constraints.py) and the bookkeeping that drops a request aborted anywhere before the
engine thread admits it; must not drive the engine (engine/loop.py adds what `take` hands it).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from vllm.engine.llm_engine import LLMEngine
from vllm.lora.request import LoRARequest
from vllm.pooling_params import PoolingParams
from vllm.sampling_params import GuidedDecodingParams, RequestOutputKind, SamplingParams

from triton_vllm_multistep.engine.constraints import ConstraintBuilder
from triton_vllm_multistep.engine.events import EngineRequest
from triton_vllm_multistep.engine.multimodal import ImagePromptProcessor


def sampling_params(sampling: Mapping[str, Any]) -> SamplingParams:
    """vLLM's SamplingParams from an EngineRequest's `sampling` (field name → JSON value): what the
    stub's codec built from the same fields (tests/unit/test_engine_request.py checks it is equal)."""
    fields = dict(sampling)
    guided = fields.get("guided_decoding")
    if guided is not None:
        fields["guided_decoding"] = GuidedDecodingParams(**guided)
    kind = fields.get("output_kind")
    if kind is not None:
        fields["output_kind"] = RequestOutputKind[kind]
    bias = fields.get("logit_bias")
    if bias is not None:
        fields["logit_bias"] = {int(token): value for token, value in bias.items()}  # JSON keys are strings
    return SamplingParams(**fields)


def pooling_params(pooling: Mapping[str, Any], model_config: Any) -> PoolingParams:
    """vLLM's PoolingParams from an EngineRequest's `pooling` fields, checked against the model as
    vLLM's OpenAI server checks them (`dimensions` only for a model trained for it, matryoshka):
    ValueError in vLLM's words."""
    params = PoolingParams(**pooling)
    params.verify(model_config)
    return params


def lora_request(adapter: tuple[str, int, str] | None) -> LoRARequest | None:
    """vLLM's LoRARequest for an EngineRequest's adapter (name, lora_int_id, path); None: the base model."""
    return None if adapter is None else LoRARequest(*adapter)


def _constraint(item: Admission) -> GuidedDecodingParams | None:
    """A generation request's structured-output constraint (an embedding request has none)."""
    return getattr(item.params, "guided_decoding", None)


@dataclass
class Admission:
    """A request on its way into the engine, with vLLM's objects built."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams  # PoolingParams: an embedding request
    lora_request: LoRARequest | None = None
    images: tuple[bytes, ...] = ()  # encoded image files for the prompt's placeholders, in order
    processed: Any = None  # vLLM's processed inputs of an image prompt (engine/multimodal.py)
    aborted: bool = False  # aborted before the engine thread admitted it: never admitted
    priority: int = 0  # vLLM's request priority


class Admissions:
    """Every request submitted and not yet admitted or refused, by id, and the prepared ones in order.

    An abort marks a request here whether it is queued for admission or still being prepared off
    the engine thread (image prompts processed, then constraints built), so that no abort is lost
    between submission and admission. `submit` runs on any thread, the preparation threads call
    back, `abort`, `take`, `lost` and `stop` run on the engine thread.
    """

    def __init__(
        self,
        engine: Callable[[], LLMEngine],
        wake: Callable[[], None],
        refuse: Callable[[str, str], None],
    ) -> None:
        self._engine = engine  # the built engine (preparation threads start at their first request)
        self._wake = wake  # the engine thread has a prepared request to admit
        self._refuse = refuse  # (request id, message): the request fails alone
        self._ready: deque[Admission] = deque()
        self._pending: dict[str, Admission] = {}
        self._lock = threading.Lock()
        self._builder: ConstraintBuilder | None = None
        self._image_processor: ImagePromptProcessor | None = None
        # Requests whose constraint failed during the engine's last step (engine/constraints.ConstraintGuard).
        self.constraint_failures: list[tuple[str, str]] = []

    def submit(self, request: EngineRequest) -> None:
        """Build the request's vLLM objects and queue it for the engine thread, through its
        preparation threads if it needs them."""
        try:
            pooling = None if request.pooling is None else pooling_params(request.pooling, self._engine().model_config)
        except ValueError as error:  # what the model cannot do, in vLLM's words
            self._refuse(request.request_id, str(error))
            return
        try:
            params = sampling_params(request.sampling) if pooling is None else pooling
        except Exception as error:  # vLLM's own checks of the fields (the stub imports no vLLM): that request alone
            self._refuse(request.request_id, f"{request.sampling_source}: {error}")
            return
        try:
            item = Admission(
                request.request_id,
                list(request.prompt_token_ids),
                params,
                lora_request(request.adapter),
                tuple(request.images),
                priority=request.priority,
            )
        except Exception as error:  # what else vLLM refuses of it
            self._refuse(request.request_id, f"the engine cannot take this request: {type(error).__name__}: {error}")
            return
        with self._lock:
            self._pending[item.request_id] = item
        if item.images or _constraint(item) is not None:
            self._prepare(item)
            return
        self._ready.append(item)
        self._wake()

    def abort(self, request_id: str) -> None:
        """Engine thread: drop the request if it is not admitted yet, wherever it is now."""
        with self._lock:
            if (pending := self._pending.get(request_id)) is not None:
                pending.aborted = True

    def take(self) -> Iterator[Admission]:
        """Engine thread: the prepared requests not aborted, in order, each forgotten here as taken."""
        while self._ready:
            item = self._ready.popleft()
            with self._lock:
                if self._pending.get(item.request_id) is item:
                    del self._pending[item.request_id]
            if not item.aborted:
                yield item

    def lost(self) -> list[str]:
        """Engine thread, the engine dead: the ids of the requests that will never be admitted now."""
        with self._lock:
            pending = [request_id for request_id, item in self._pending.items() if not item.aborted]
            self._pending.clear()
        self._ready.clear()
        return pending

    def stop(self) -> None:
        """Engine thread, stopping: end the preparation threads."""
        for preparer in (self._builder, self._image_processor):
            if preparer is not None:
                preparer.stop()

    def _prepare(self, item: Admission) -> None:
        """Hand a request to its next preparation thread, or queue it for admission once prepared."""
        if item.images and item.processed is None:
            with self._lock:
                if self._image_processor is None:
                    self._image_processor = ImagePromptProcessor(self._engine())
            self._image_processor.submit(
                item.request_id,
                item.prompt_token_ids,
                item.images,
                item.lora_request,
                self._image_processed,
                self._refused,
            )
        elif _constraint(item) is not None:
            with self._lock:
                if self._builder is None:
                    self._builder = ConstraintBuilder(self._engine(), self.constraint_failures)
            self._builder.submit(item.request_id, item.params, self._constraint_built, self._refused)  # type: ignore[arg-type]
        else:
            # Prepared: the engine thread admits it, or drops it if it was aborted meanwhile.
            self._ready.append(item)
            self._wake()

    def _still_wanted(self, request_id: str) -> Admission | None:
        """A preparation thread's request, unless it was aborted meanwhile (then forgotten)."""
        with self._lock:
            item = self._pending.get(request_id)
            if item is not None and item.aborted:
                del self._pending[request_id]
                return None
            return item

    def _image_processed(self, request_id: str, processed: Any) -> None:
        """Image prompt thread: the prompt is processed; on to its constraint or admission."""
        if (item := self._still_wanted(request_id)) is not None:
            item.processed = processed
            self._prepare(item)

    def _constraint_built(self, request_id: str, params: SamplingParams) -> None:
        """Constraint builder thread: the constraint is built; on to admission."""
        if (item := self._still_wanted(request_id)) is not None:
            item.params = params
            self._prepare(item)

    def _refused(self, request_id: str, message: str) -> None:
        """A preparation thread could not prepare the request; it fails alone (unless aborted meanwhile)."""
        with self._lock:
            item = self._pending.pop(request_id, None)
            if item is None or item.aborted:
                return
        self._refuse(request_id, message)

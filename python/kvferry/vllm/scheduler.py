"""Scheduler side of kvferry's vLLM connector: decides which requests load KV from a producer
(consumer role) and which hold their KV for a consumer (producer role), and hands that to the
worker ranks as :class:`~kvferry.vllm.metadata.KvferryConnectorMetadata`.

The flow is the push flow of vLLM's MooncakeConnector (vLLM 0.32,
`v1/mooncake/mooncake_connector.py`, `MooncakeConnectorScheduler`): the consumer asks, the
producer WRITEs the prompt's KV into the consumer's blocks and replies FINISH. Requests are
duck-typed vLLM `Request`s (`request_id`, `kv_transfer_params`, `prompt_token_ids`, `status`).
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from typing import Any, Sequence

from kvferry.vllm import params as P
from kvferry.vllm.metadata import KvferryConnectorMetadata, LoadSpec, SendSpec

# Under vLLM's logger, so vLLM's logging configuration (format, level) applies.
log = logging.getLogger("vllm.kvferry")


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler side needs to know about its engine.

    ``host``/``port``: the side-channel base address the producer names in its reply (head unit
    ``j`` of layer unit ``k`` of rank ``(tp, pp)`` listens on ``port + ((pp * tp_size + tp) *
    layer_splits + k) * head_splits + j``).
    ``lease_seconds``: how long a producer holds a finished request's blocks for its consumer.
    ``head_splits`` / ``layer_splits``: head and layer units per producer rank, and
    ``stage_layers``: each PP stage's layer numbers ``[start, end)`` (vLLM's ``get_pp_indices``;
    None: not sent), all named in the reply (docs/vllm-connector-notes.md §8)."""

    engine_id: str
    is_producer: bool
    is_consumer: bool
    host: str
    port: int
    tp_size: int
    pp_size: int
    block_size: int
    lease_seconds: float
    head_splits: int = 1
    layer_splits: int = 1
    stage_layers: tuple[tuple[int, int], ...] | None = None
    # The producers a consumer loads from (``allowed_producers``); None: any address.
    allowed_producers: P.ProducerAllowlist | None = None


class KvferrySchedulerSide:
    """The scheduler-side state; one per engine, driven by vLLM's scheduler thread."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        if config.is_consumer and config.allowed_producers is None:
            log.warning("kvferry: no allowed_producers in kv_connector_extra_config: this consumer connects to "
                        "whatever producer address a request's kv_transfer_params name (trusted clients only)")
        self._new_loads: list[LoadSpec] = []
        self._new_sends: list[SendSpec] = []
        # request id -> transfer id of sends whose blocks the producer still holds
        self.held: dict[str, str] = {}
        # request id -> tokens computed locally when the remote match was counted
        self._local_tokens: dict[str, int] = {}

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Consumer: every prompt token past the local prefix hit loads asynchronously from the
        producer; ``(0, False)`` for any other request (or malformed params: logged, computed
        locally)."""
        kvp = request.kv_transfer_params
        if not P.wants_remote_prefill(kvp):
            return 0, False
        if not self.config.is_consumer:
            log.warning("request %s asks for a remote prefill but this engine is not a consumer; computing locally",
                        request.request_id)
            return 0, False
        try:
            P.remote_source(kvp, self.config.allowed_producers)
        except P.ParamsError as e:
            log.warning("request %s: %s; computing its prompt locally", request.request_id, e)
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        if count <= 0:
            return 0, False
        self._local_tokens[request.request_id] = num_computed_tokens
        return count, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Consumer: queue the load into the blocks just allocated (the unhashed ones: a local
        prefix hit is not reloaded). Only one load per request: ``do_remote_prefill`` is cleared."""
        kvp = request.kv_transfer_params
        if not P.wants_remote_prefill(kvp) or not self.config.is_consumer:
            return
        kvp[P.DO_REMOTE_PREFILL] = False
        local = self._local_tokens.pop(request.request_id, 0)
        if num_external_tokens <= 0:
            return
        try:
            source = P.remote_source(kvp, self.config.allowed_producers)
        except P.ParamsError as e:  # checked in get_num_new_matched_tokens; params may change
            log.warning("request %s: %s; not loading", request.request_id, e)
            return
        block_ids = tuple(tuple(int(b) for b in g) for g in blocks.get_unhashed_block_ids_all_groups())
        self._new_loads.append(
            LoadSpec(request_id=request.request_id, source=source, block_ids=block_ids,
                     num_tokens=local + num_external_tokens, num_local_computed=local)
        )

    def request_finished(self, request: Any, block_ids: Sequence[Sequence[int]]) -> tuple[bool, dict[str, Any] | None]:
        """Producer: a prefill that ran to its length cap with ``do_remote_decode`` keeps its
        blocks (returns True: vLLM frees them when a worker reports the request in
        ``finished_sending``) and returns the params the proxy hands to the consumer. A request
        whose ``transfer_id`` another held request has is not kept (returns ``(False, None)``)."""
        kvp = request.kv_transfer_params
        if not P.wants_remote_decode(kvp) or not self.config.is_producer:
            return False, None
        try:
            transfer_id = P.transfer_id_of(kvp)
        except P.ParamsError as e:
            log.warning("request %s: %s; its KV is not kept for a consumer", request.request_id, e)
            return False, None
        # Aborted or errored prefills have nothing for a consumer: free at once.
        if getattr(request.status, "name", str(request.status)) != "FINISHED_LENGTH_CAPPED":
            return False, None
        # A transfer id already held names another request's KV: the producer would publish it
        # twice (and lose the first request's release). Refused here; the first one stays held.
        if transfer_id in self.held.values():
            log.warning("request %s: transfer id %r is already held for another request; its KV is not kept "
                        "for a consumer", request.request_id, transfer_id)
            return False, None
        groups = tuple(tuple(int(b) for b in g) for g in block_ids)
        if not any(groups):
            return False, None
        num_tokens = len(request.prompt_token_ids or ())
        # The prompt's blocks only: the sampled token's block (if any) is not sent.
        groups = tuple(g[: -(-num_tokens // self.config.block_size)] for g in groups)
        # The lease's load key: whoever holds these params may load the KV, nobody else.
        load_key = secrets.token_urlsafe(24)
        self._new_sends.append(
            SendSpec(request_id=request.request_id, transfer_id=transfer_id, block_ids=groups,
                     num_tokens=num_tokens, lease_seconds=self.config.lease_seconds,
                     load_key=load_key)
        )
        self.held[request.request_id] = transfer_id
        c = self.config
        return True, P.producer_reply(transfer_id, c.engine_id, c.host, c.port, c.tp_size, c.pp_size,
                                      groups, load_key, head_splits=c.head_splits, layer_splits=c.layer_splits,
                                      stage_layers=c.stage_layers)

    def build_connector_meta(self) -> KvferryConnectorMetadata:
        """This step's new loads and sends; the queues start empty again."""
        meta = KvferryConnectorMetadata(loads=self._new_loads, sends=self._new_sends)
        self._new_loads, self._new_sends = [], []
        return meta

    def update_connector_output(self, finished_sending: set[str] | None) -> None:
        """Forget sends whose blocks vLLM frees now."""
        for rid in finished_sending or ():
            self.held.pop(rid, None)

    def has_pending_push_work(self) -> bool:
        """True while a producer holds blocks: vLLM keeps stepping so that leases expire."""
        return bool(self.held) or bool(self._new_sends)

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
from kvferry.vllm.groups import block_size_refusal, consumer_table, producer_table
from kvferry.vllm.metadata import KvferryConnectorMetadata, LoadOrder, SendOrder

# Under vLLM's logger, so vLLM's logging configuration (format, level) applies.
log = logging.getLogger("vllm.kvferry")


# Set in a producer request's params once its prompt's last token is dropped (on_new_request).
TRUNCATED = "_kvferry_truncated"


def loaded_tokens(num_prompt_tokens: int, has_state: bool) -> int:
    """Prompt tokens a consumer loads: all of them, or all but the last one for a model with
    Mamba-type state (a prompt of one token then loads nothing)."""
    return num_prompt_tokens - 1 if has_state else num_prompt_tokens


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler side needs to know about its engine.

    ``host``/``port``: the side-channel base address the producer names in its reply (where
    each unit listens: :func:`kvferry.vllm.params.unit_port`).
    ``lease_seconds``: how long a producer holds a finished request's blocks for its consumer.
    ``head_splits`` / ``layer_splits``: head and layer units per producer rank, and
    ``stage_layers``: each PP stage's layer numbers ``[start, end)`` (vLLM's ``get_pp_indices``;
    None: not sent), all named in the reply (docs/vllm-connector-notes.md §8).
    ``group_block_sizes``: the block size in tokens of each KV cache group the connector moves,
    in vLLM's group order (``kv_cache_groups``; empty: one group of ``block_size``), named in
    the reply as ``remote_block_sizes`` and compared with a producer's before a load;
    ``group_windows``: each group's sliding window (None: full attention);
    ``group_kv_layouts``: each group's layout tag (None: the shape decides), named in the reply
    as ``remote_kv_layouts`` and compared with a producer's before a load."""

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
    # The producers a consumer loads from (``allowed_producers``, or loopback only in open mode);
    # None: any address (secret mode: every producer proves the secret before it gets anything).
    allowed_producers: P.ProducerAllowlist | P.LoopbackOnly | None = None
    group_block_sizes: tuple[int, ...] = ()
    # Each group's sliding window in tokens (None: full attention), in the same order.
    group_windows: tuple[int | None, ...] = ()
    # Each group's Mamba-type state flag, in the same order (any true: see ``has_state``).
    group_states: tuple[bool, ...] = ()
    # Each group's KV cache layout tag (kvferry.vllm.layouts.kv_layout_tags), in the same order:
    # named in the reply as ``remote_kv_layouts``, compared with a producer's before a load.
    group_kv_layouts: tuple[str | None, ...] = ()

    @property
    def has_state(self) -> bool:
        """True when some group holds Mamba-type state: the consumer recomputes the prompt's last
        token (its logits need a forward pass, and a state already holding that token would take
        it twice), so the producer stops short of it and the consumer loads one token less."""
        return any(self.group_states)

    @property
    def block_sizes(self) -> tuple[int, ...]:
        """Each group's block size (``group_block_sizes``, else one group of ``block_size``)."""
        return self.group_block_sizes or (self.block_size,)


class KvferrySchedulerSide:
    """The scheduler-side state; one per engine, driven by vLLM's scheduler thread."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        if config.is_consumer and isinstance(config.allowed_producers, P.LoopbackOnly):
            log.warning("kvferry: neither allowed_producers nor secret_file in kv_connector_extra_config: this "
                        "consumer loads from producers on this host only (set allowed_producers for others)")
        self._new_loads: list[LoadOrder] = []
        self._new_sends: list[SendOrder] = []
        # request id -> transfer id of sends whose blocks the producer still holds
        self.held: dict[str, str] = {}
        # request id -> tokens computed locally when the remote match was counted
        self._local_tokens: dict[str, int] = {}
        # request id -> why its load is refused before any byte moves (reported as a failed load)
        self._refused: dict[str, str] = {}

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Consumer: every prompt token past the local prefix hit loads asynchronously from the
        producer; ``(0, False)`` for any other request (or malformed params, or a producer whose
        block sizes this instance cannot verify against, :func:`~kvferry.vllm.groups.block_size_refusal`: logged,
        computed locally, before any byte moves). A producer whose KV cache layout differs from
        this instance's (:func:`~kvferry.vllm.params.kv_layout_refusal`) is refused before any
        byte moves too, but as a failed load: the load is queued with its refusal, and the
        workers report it failed without connecting, so vLLM's ``kv_load_failure_policy``
        decides (fail the request, or recompute it)."""
        kvp = request.kv_transfer_params
        if not P.wants_remote_prefill(kvp):
            return 0, False
        if not self.config.is_consumer:
            log.warning("request %s asks for a remote prefill but this engine is not a consumer; computing locally",
                        request.request_id)
            return 0, False
        try:
            source = P.remote_source(kvp, self.config.allowed_producers)
        except P.ParamsError as e:
            log.warning("request %s: %s; computing its prompt locally", request.request_id, e)
            return 0, False
        local = self.config.block_sizes
        remote = source.block_sizes or tuple(local[g] if g < len(local) else local[0]
                                             for g in range(len(source.remote_block_ids)))
        loaded = loaded_tokens(len(request.prompt_token_ids or ()), self.config.has_state)
        refusal = block_size_refusal(remote, local, self.config.group_windows, loaded, num_computed_tokens,
                                     self.config.group_states)
        if refusal is not None:
            log.warning("request %s: not loaded from producer %s (transfer %s): %s; computing its prompt locally",
                        request.request_id, source.engine_id, source.transfer_id, refusal)
            return 0, False
        count = loaded - num_computed_tokens
        if count <= 0:
            return 0, False
        layout = P.kv_layout_refusal(source.kv_layouts, self._kv_layouts(len(local)))
        if layout is not None:
            log.warning("request %s: load from producer %s (transfer %s) refused before any byte moves: %s; reported "
                        "as a failed load to vLLM's kv_load_failure_policy", request.request_id, source.engine_id,
                        source.transfer_id, layout)
            self._refused[request.request_id] = layout
        else:
            self._refused.pop(request.request_id, None)
        self._local_tokens[request.request_id] = num_computed_tokens
        return count, True

    def _kv_layouts(self, groups: int) -> tuple[str | None, ...]:
        """This instance's layout tag per group (None throughout where the config names none)."""
        return self.config.group_kv_layouts or tuple(None for _ in range(groups))

    def on_new_request(self, request: Any) -> None:
        """Producer of a model with Mamba-type state: a request to prefill for a consumer
        (``do_remote_decode``) drops its prompt's last token, so that the state it leaves is the
        one after the tokens the consumer loads (:func:`loaded_tokens`); the consumer computes
        the last token itself. Done once per request (vLLM may add it again after a preemption)."""
        kvp = request.kv_transfer_params
        if not (self.config.is_producer and self.config.has_state and P.wants_remote_decode(kvp)):
            return
        if kvp.get(TRUNCATED) or request.prompt_token_ids is None or len(request.prompt_token_ids) <= 1:
            return
        prompt = request.prompt_token_ids
        # A new list: the caller's (an offline LLM.generate's prompt) is not ours to cut.
        request.prompt_token_ids = list(prompt[:-1])
        all_ids = getattr(request, "_all_token_ids", None)  # vLLM's Request: its own copy, prompt + output
        if all_ids is not None and all_ids is not prompt:
            del all_ids[-1:]
        request.num_prompt_tokens -= 1
        kvp[TRUNCATED] = True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Consumer: queue the load into the blocks just allocated, one table per KV cache group
        (``blocks.blocks``: vLLM's blocks of each group by request position; a local prefix hit
        is not reloaded, a null block outside a sliding window not written). Only one load per
        request: ``do_remote_prefill`` is cleared."""
        kvp = request.kv_transfer_params
        if not P.wants_remote_prefill(kvp) or not self.config.is_consumer:
            return
        kvp[P.DO_REMOTE_PREFILL] = False
        local = self._local_tokens.pop(request.request_id, 0)
        refusal = self._refused.pop(request.request_id, None)
        if num_external_tokens <= 0:
            return
        try:
            source = P.remote_source(kvp, self.config.allowed_producers)
        except P.ParamsError as e:  # checked in get_num_new_matched_tokens; params may change
            log.warning("request %s: %s; not loading", request.request_id, e)
            return
        num_tokens = local + num_external_tokens
        # Each group's table by request position (null and prefix-hit blocks None).
        block_ids = tuple(consumer_table(list(g), num_tokens, bs)
                          for g, bs in zip(blocks.blocks, self.config.block_sizes))
        self._new_loads.append(
            LoadOrder(request_id=request.request_id, source=source, block_ids=block_ids,
                     num_tokens=num_tokens, num_local_computed=local, refusal=refusal)
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
        num_tokens = len(request.prompt_token_ids or ())
        sizes = self.config.block_sizes
        if len(block_ids) != len(sizes):
            log.warning("request %s: %d block tables for %d KV cache groups; its KV is not kept for a consumer",
                        request.request_id, len(block_ids), len(sizes))
            return False, None
        # The prompt's blocks only (the sampled token's block, if any, is not sent); vLLM's null
        # block (outside a sliding window) as None.
        groups = tuple(producer_table(list(g), num_tokens, bs) for g, bs in zip(block_ids, sizes))
        if not any(b is not None for g in groups for b in g):
            return False, None
        # The lease's load key: whoever holds these params may load the KV, nobody else.
        load_key = secrets.token_urlsafe(24)
        self._new_sends.append(
            SendOrder(request_id=request.request_id, transfer_id=transfer_id, block_ids=groups,
                     num_tokens=num_tokens, lease_seconds=self.config.lease_seconds,
                     load_key=load_key)
        )
        self.held[request.request_id] = transfer_id
        c = self.config
        return True, P.producer_reply(transfer_id, c.engine_id, c.host, c.port, c.tp_size, c.pp_size,
                                      groups, load_key, head_splits=c.head_splits, layer_splits=c.layer_splits,
                                      stage_layers=c.stage_layers, block_sizes=c.block_sizes,
                                      kv_layouts=c.group_kv_layouts or None)

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

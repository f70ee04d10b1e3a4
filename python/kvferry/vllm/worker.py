"""Worker side of kvferry's vLLM connector: one per vLLM worker process, i.e. per TP/PP rank.

It registers the rank's KV cache tensors, holds a producer rank's finished requests under a
lease, runs a consumer rank's loads off the forward path (a thread per load, each with a
deadline), and reports to vLLM: ``finished_sending`` / ``finished_recving`` / ``failed_recving`` through
``get_transfer_results`` (:meth:`KvferryWorkerSide.transfer_results`), and with one KV cache group
also the blocks of failed loads through ``get_block_ids_with_load_errors`` (vLLM's
``kv_load_failure_policy`` then fails or recomputes the request; with several groups vLLM 0.32
takes failed requests only: its block ids are unique per group, not across groups). A load counts as finished only
once its transport returned a result (landed and verified, or failed).

The data path is a :class:`RankTransport`: :class:`kvferry.vllm.transport.KvferryTransport`
(kvferry's p2p Producer/Consumer of this rank: WRITEs, checksums, verdicts, policy).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Protocol

from kvferry.outcomes import Release, ReleaseReason, Verdict
from kvferry.vllm.metadata import KvferryConnectorMetadata, LoadOrder, SendOrder

# Under vLLM's logger, so vLLM's logging configuration (format, level) applies.
log = logging.getLogger("vllm.kvferry")


@dataclass(frozen=True)
class LayerInfo:
    """One registered KV cache tensor of this rank (vLLM's layer name, the tensor's address,
    bytes, shape, strides in elements, dtype name)."""

    name: str
    data_ptr: int
    nbytes: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    device: str


@dataclass(frozen=True)
class LoadResult:
    """What a transport says about one load: ``ok`` (landed and verified, or landed and
    unverified under fail-open) or not, the verdict, and a reason for the log."""

    ok: bool
    verdict: Verdict
    reason: str = ""


class RankTransport(Protocol):
    """One rank's data path: register the rank's KV tensors, serve a producer rank's held
    request to its consumers, report served/expired sends as ``(request id, reason)``, load a
    consumer rank's request from its producer ranks (by ``deadline``, a ``time.monotonic()``).
    ``serve``'s ``on_publish`` (when given) is called right before the transport publishes the
    send (where its lease starts); False means the worker freed the blocks already: the send is
    dropped unpublished."""

    def register(self, kv_caches: dict) -> None: ...

    def serve(self, send: SendOrder, on_publish: Callable[[], bool] | None = None) -> None: ...

    def released(self) -> list[tuple[str, ReleaseReason]]: ...

    def load(self, spec: LoadOrder, deadline: float) -> LoadResult: ...

    def shutdown(self) -> None: ...


@dataclass
class _Held:
    """A send whose blocks are held until its consumer is served or ``expires`` (monotonic s)."""

    send: SendOrder
    expires: float


class KvferryWorkerSide:
    """One rank's worker-side state; called by vLLM's model runner thread, loads run on a pool."""

    # The transport's own lease releases held blocks; this backstop frees them if it never says.
    # It counts from the publish (where kvferry's lease starts); a send still waiting for the
    # publish thread that long is freed and then dropped unpublished (review fix, notes §7).
    LEASE_BACKSTOP_SECONDS = 10.0

    def __init__(self, tp_rank: int, pp_rank: int, load_timeout_seconds: float,
                 transport: RankTransport, max_parallel_loads: int = 4,
                 clock: Callable[[], float] = time.monotonic, report_blocks: bool = True):
        """``clock``: seconds, monotonic; the lease backstop's clock (tests pass their own).
        ``report_blocks``: failed loads' blocks go to :meth:`get_block_ids_with_load_errors`
        too (one KV cache group only: vLLM 0.32 stops on block ids with several groups)."""
        self.report_blocks = report_blocks
        self._clock = clock
        self.tp_rank = tp_rank
        self.pp_rank = pp_rank
        self.load_timeout_seconds = load_timeout_seconds
        self.transport = transport
        self.layers: list[LayerInfo] = []
        self._held: dict[str, _Held] = {}
        self._served: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._done_loads: queue.SimpleQueue[tuple[LoadOrder, LoadResult]] = queue.SimpleQueue()
        self._load_errors: set[int] = set()
        self._failed: set[str] = set()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_parallel_loads, thread_name_prefix="kvferry-load")

    def register_kv_caches(self, kv_caches: dict) -> list[LayerInfo]:
        """Records every layer's tensor (several layers may share one storage); a Mamba-type
        layer's list of state tensors as ``<name>.state<i>``."""
        tensors = [(f"{name}.state{i}", s) if isinstance(t, (list, tuple)) else (name, s)
                   for name, t in kv_caches.items()
                   for i, s in enumerate(t if isinstance(t, (list, tuple)) else [t])]
        self.layers = [
            LayerInfo(name=name, data_ptr=t.data_ptr(), nbytes=t.numel() * t.element_size(),
                      shape=tuple(t.shape), stride=tuple(t.stride()), dtype=str(t.dtype).removeprefix("torch."),
                      device=str(t.device))
            for name, t in tensors
        ]
        self.transport.register(kv_caches)
        if self.layers:
            first = self.layers[0]
            log.info("kvferry rank tp=%d pp=%d: %d KV layers, e.g. %s shape %s stride %s %s on %s",
                     self.tp_rank, self.pp_rank, len(self.layers), first.name, first.shape,
                     first.stride, first.dtype, first.device)
        return self.layers

    def start(self, meta: KvferryConnectorMetadata) -> None:
        """Takes this step's new sends (held under their lease) and loads (started now)."""
        now = self._clock()
        for send in meta.sends:
            with self._lock:
                self._held[send.request_id] = _Held(send, now + send.lease_seconds + self.LEASE_BACKSTOP_SECONDS)
            self.transport.serve(send, lambda send=send: self._publishing(send))
        for spec in meta.loads:
            deadline = now + self.load_timeout_seconds
            self._pool.submit(self._run_load, spec, deadline)

    def _publishing(self, send: SendOrder) -> bool:
        """The transport's publish thread is about to publish ``send`` (its lease starts): the
        backstop restarts from now. False when the backstop freed its blocks already (then it
        must not be published: vLLM may have reused them)."""
        with self._lock:
            held = self._held.get(send.request_id)
            if held is None or held.send is not send:
                return False
            held.expires = self._clock() + send.lease_seconds + self.LEASE_BACKSTOP_SECONDS
            return True

    def _run_load(self, spec: LoadOrder, deadline: float) -> None:
        if spec.refusal is not None:  # refused by the scheduler: nothing connects, nothing moves
            record = getattr(self.transport, "record_refused", None)  # test transports keep no stats
            if record is not None:
                record()
            self._done_loads.put((spec, LoadResult(ok=False, verdict=Verdict.UNVERIFIED,
                                                   reason=f"refused before any transfer: {spec.refusal}")))
            return
        try:
            result = self.transport.load(spec, deadline)
        except Exception as e:  # a transport bug must not strand the request in WAITING_FOR_REMOTE_KVS
            result = LoadResult(ok=False, verdict=Verdict.UNVERIFIED, reason=f"transport raised {e!r}")
        self._done_loads.put((spec, result))

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose held blocks may be freed, requests whose load ended); a failed load
        ends too, its request going to :meth:`take_failed` (and its blocks to
        :meth:`get_block_ids_with_load_errors` with ``report_blocks``) first."""
        sending: set[str] = set()
        for rid, reason in self.transport.released():
            if reason.kind is not Release.SERVED:
                log.warning("kvferry: request %s released without serving its consumer (%s); freeing its blocks",
                            rid, reason)
            self._served.put(rid)
        with self._lock:
            while not self._served.empty():
                rid = self._served.get()
                if self._held.pop(rid, None) is not None:
                    sending.add(rid)
            now = self._clock()
            for rid in [r for r, h in self._held.items() if h.expires <= now]:
                log.warning("kvferry: request %s (transfer %s) held past its lease without a release; freeing its "
                            "blocks", rid, self._held[rid].send.transfer_id)
                del self._held[rid]
                sending.add(rid)
        recving: set[str] = set()
        while not self._done_loads.empty():
            spec, result = self._done_loads.get()
            recving.add(spec.request_id)
            if not result.ok:
                blocks = {b for group in spec.block_ids for b in group if b is not None}
                log.error("kvferry: load of request %s (transfer %s) failed (%s): %s; %d blocks reported to vLLM's kv_load_failure_policy",
                          spec.request_id, spec.source.transfer_id, result.verdict, result.reason, len(blocks))
                with self._lock:
                    self._failed.add(spec.request_id)
                    if self.report_blocks:
                        self._load_errors |= blocks
        return sending or None, recving or None

    def take_failed(self) -> set[str]:
        """Requests whose load failed since the last call (drained); each was (or is, in the
        same :meth:`get_finished`) reported as finished too."""
        with self._lock:
            failed, self._failed = self._failed, set()
        return failed

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) of this step: vLLM's
        ``KVConnectorTransferResults``; a failed load is in both of the last two."""
        sending, recving = self.get_finished()
        return set(sending or ()), set(recving or ()), self.take_failed()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of loads that failed since the last call (drained)."""
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.transport.shutdown()

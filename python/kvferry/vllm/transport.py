"""kvferry's per-rank data path for the vLLM connector: one :class:`kvferry.Producer` (producer
rank) and/or one :class:`kvferry.Consumer` (consumer rank) per vLLM worker process, over the
rank's own KV cache tensors (docs/python-verified-loads.md, "Ranks and processes").

Push flow: a consumer rank asks the producer rank of the same ``(tp, pp)`` (its control endpoint
``tcp://remote_host:remote_port + pp * tp_size + tp``) to WRITE the request's blocks into its
own blocks; the producer replies FINISH with its checksum payload (computed when the request
was published); the consumer checksums the landed blocks with kvferry's kernels, compares, and
applies the policy (fail-closed, ``kv_load_failure_policy``) before the load counts as done.
Both sides' checksums cover this rank's KV heads only (global head indices), so a pair verifies
its rank; the two instances need the same TP and PP sizes.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import kvferry

from kvferry.vllm.metadata import LoadSpec, SendSpec
from kvferry.vllm.worker import LoadResult

# Under vLLM's logger, so vLLM's logging configuration (format, level) applies.
log = logging.getLogger("vllm.kvferry")


class LayoutError(ValueError):
    """A KV cache tensor whose layout the connector does not know; the message gives its shape."""


@dataclass(frozen=True)
class TransportConfig:
    """One rank's transport settings (from ``kv_connector_extra_config``, see connector.py).

    ``host``: the address this rank's transfer engine and control socket listen on and name to
    peers; ``port``: the side-channel base port (rank ``(tp, pp)`` binds ``port + pp * tp_size +
    tp``); ``protocol``: ``"tcp"`` | ``"rdma"`` | ``"auto"``; ``fail_closed``: an unverifiable
    load fails; ``load_failure_policy``: vLLM's ``kv_load_failure_policy`` (``"fail"`` |
    ``"recompute"``, named in kvferry's logs); ``lease_seconds``: how long a producer holds
    published blocks; ``load_timeout_seconds``: one load's deadline (a producer's WRITEs for one
    load may take half of its own); ``connect_timeout_seconds``:
    connecting to a producer; ``test_corrupt_transfer_prefix``: test-only fault injection, flips a
    bit of the first landed block of every load whose transfer id starts with it (None: off)."""

    host: str
    port: int
    protocol: str = "tcp"
    fail_closed: bool = True
    load_failure_policy: str = "fail"
    lease_seconds: float = 30.0
    load_timeout_seconds: float = 30.0
    connect_timeout_seconds: float = 5.0
    test_corrupt_transfer_prefix: str | None = None


def layer_view(t: Any, block_size: int) -> tuple[Any, str]:
    """``(view, layout)`` of one layer's KV cache tensor in kvferry's axis names (outermost
    first; strides are read from the view, so a permuted physical order is fine).

    - vLLM CPU attention (0.32, ``cpu_attn.py``): each layer's tensor is ``[B, H, N, 2 * D]``
      (contiguous), which the kernel reads as ``[B, H, 2 * N, D]``: K in the first N rows of a
      block's head, V in the next. Viewed as ``[B, H, 2, N, D]`` = ``"B H KV N D"``.
    - vLLM FlashAttention / FlashInfer: ``[2, B, N, H, D]`` = ``"KV B N H D"``.

    Raises :class:`LayoutError` for any other shape (MLA's ``[B, N, D]`` included: not handled)."""
    shape = tuple(t.shape)
    if len(shape) == 4 and t.device.type == "cpu" and shape[2] == block_size and shape[3] % 2 == 0:
        b, h, n, d2 = shape
        return t.view(b, h, 2, n, d2 // 2), "B H KV N D"
    if len(shape) == 5 and shape[0] == 2 and shape[2] == block_size:
        return t, "KV B N H D"
    raise LayoutError(
        f"KV cache tensor of shape {shape} (block_size {block_size}) has no known layout: "
        "expected CPU [B, H, 2*N, D] or [2, B, N, H, D]"
    )


class KvferryTransport:
    """One rank's :class:`~kvferry.vllm.worker.RankTransport` over kvferry's p2p layer.

    Built per worker process; :meth:`register` (from ``register_kv_caches``) builds the rank's
    Producer and/or Consumer over its tensors. Errors: :class:`LayoutError` for an unknown
    tensor layout; kvferry's ValueError/RuntimeError when an engine cannot start."""

    def __init__(self, config: TransportConfig, *, tp_rank: int, pp_rank: int, tp_size: int, pp_size: int,
                 block_size: int, is_producer: bool, is_consumer: bool):
        self.config = config
        self.tp_rank, self.pp_rank = tp_rank, pp_rank
        self.tp_size, self.pp_size = tp_size, pp_size
        self.block_size = block_size
        self.is_producer, self.is_consumer = is_producer, is_consumer
        self.producer: Any = None
        self.consumer: Any = None
        self._views: dict[str, tuple[Any, str]] = {}
        # transfer id -> vLLM request id of published sends
        self._published: dict[str, str] = {}
        self._lock = threading.Lock()
        self._publish_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvferry-publish")

    def rank_port(self) -> int:
        """This rank's control port (producer side)."""
        return self.config.port + self.pp_rank * self.tp_size + self.tp_rank

    def register(self, kv_caches: dict[str, Any]) -> None:
        """Describes the rank's layers to kvferry and starts its Producer and/or Consumer."""
        layers = []
        for name, t in kv_caches.items():
            view, layout = layer_view(t, self.block_size)
            self._views[name] = (view, layout)
            heads = view.shape[layout.split().index("H")]
            layers.append(kvferry.KVCacheLayer(name, view, layout, head_offset=self.tp_rank * heads,
                                               kind="FullAttentionSpec", dtype=str(t.dtype)))
        rank = kvferry.Rank([kvferry.KVCacheGroup(0, layers)])
        c = self.config
        if self.is_producer:
            self.producer = kvferry.Producer(
                [rank], bind=f"tcp://{c.host}:{self.rank_port()}", host=c.host, protocol=c.protocol,
                # A consumer's load must leave the producer its whole transfer time (kvferry's p2p
                # refuses a budget below it): half the load timeout, so equal configs pair.
                lease=c.lease_seconds, transfer_timeout=c.load_timeout_seconds / 2)
            log.info("kvferry producer rank tp=%d pp=%d serves on %s (%s)", self.tp_rank, self.pp_rank,
                     self.producer.endpoint, self.producer.transport)
        if self.is_consumer:
            self.consumer = kvferry.Consumer(
                [rank], host=c.host, protocol=c.protocol, fail_closed=c.fail_closed,
                load_failure_policy=c.load_failure_policy, reply_timeout=c.load_timeout_seconds,
                max_wait=c.load_timeout_seconds, connect_timeout=c.connect_timeout_seconds)
            if c.test_corrupt_transfer_prefix is not None:
                self.consumer.set_landed_hook(self._corrupt_hook(c.test_corrupt_transfer_prefix))
                log.warning("kvferry TEST HOOK on: loads of transfers %r* get a landed bit flipped",
                            c.test_corrupt_transfer_prefix)

    def _corrupt_hook(self, prefix: str) -> Callable[[dict], None]:
        import torch

        view, layout = next(iter(self._views.values()))
        word = view.view(torch.int32) if view.element_size() == 4 else view.view(torch.int16)

        def hook(landed: dict) -> None:
            if not landed["request_id"].startswith(prefix):
                return
            for g in landed["groups"]:
                if g["local_blocks"]:
                    b = g["local_blocks"][0]
                    # K, head 0, token 0, element 0 of the first landed block of the first layer.
                    idx = (b, 0, 0, 0, 0) if layout.startswith("B") else (0, b, 0, 0, 0)
                    word[idx] ^= 0x100
                    if word.is_cuda:
                        torch.cuda.synchronize(word.device)
                    log.warning("kvferry TEST HOOK: flipped a bit of landed block %d of transfer %s",
                                b, landed["request_id"])
                    return

        return hook

    def serve(self, send: SendSpec) -> None:
        """Publishes a finished prompt's blocks (checksummed now, off the forward path)."""
        if self.producer is None:
            log.error("kvferry: request %s asks to be served but this rank has no producer", send.request_id)
            return
        with self._lock:
            self._published[send.transfer_id] = send.request_id
        self._publish_pool.submit(self._publish, send)

    def _publish(self, send: SendSpec) -> None:
        try:
            info = self.producer.publish(send.transfer_id, [list(g) for g in send.block_ids], send.num_tokens,
                                         load_key=send.load_key)
        except Exception as e:  # the lease backstop in the worker frees the blocks
            log.error("kvferry: publishing request %s (transfer %s) failed: %s", send.request_id, send.transfer_id, e)
            return
        if info.warning:
            log.warning("kvferry: transfer %s published without checksums: %s", send.transfer_id, info.warning)

    def released(self) -> list[tuple[str, str]]:
        """``(vLLM request id, reason)`` of the sends kvferry released since the last call
        (``served``, ``expired``, ``failed: ...``): their blocks may be freed."""
        if self.producer is None:
            return []
        out = []
        for transfer_id, reason in self.producer.released():
            with self._lock:
                rid = self._published.pop(transfer_id, None)
            if rid is not None:
                out.append((rid, reason))
        return out

    def load(self, spec: LoadSpec, deadline: float) -> LoadResult:
        """Loads and verifies one request's KV of this rank; blocks until done or ``deadline``."""
        if self.consumer is None:
            return LoadResult(ok=False, verdict="unverified", reason="this rank has no consumer")
        src = spec.source
        if (src.tp_size, src.pp_size) != (self.tp_size, self.pp_size):
            return LoadResult(ok=False, verdict="unverified",
                              reason=f"producer TP x PP {src.tp_size}x{src.pp_size} differs from this "
                                     f"instance's {self.tp_size}x{self.pp_size} (per-rank pairs need equal sizes)")
        bs = self.block_size
        n = -(-spec.num_tokens // bs)
        skip = spec.num_local_computed // bs
        remote, local = [], []
        for g, blocks in enumerate(spec.block_ids):
            table: list[int | None] = [None] * skip + list(blocks)
            table = (table + [None] * n)[:n]
            rtable = list(src.remote_block_ids[g])[:n] if g < len(src.remote_block_ids) else []
            if len(rtable) < n:
                return LoadResult(ok=False, verdict="unverified",
                                  reason=f"producer's block table of group {g} covers {len(rtable)} blocks, "
                                         f"the prompt needs {n}")
            remote.append(rtable)
            local.append(table)
        endpoint = f"tcp://{src.host}:{src.rank_port(self.tp_rank, self.pp_rank)}"
        timeout = max(deadline - time.monotonic(), 0.001)
        out = self.consumer.load(src.transfer_id, endpoint, remote, local, spec.num_tokens,
                                 num_local_computed=spec.num_local_computed, timeout=timeout,
                                 load_key=src.load_key)
        status = out.verdict.status if out.verdict is not None else "unverified"
        if not out.landed:
            return LoadResult(ok=False, verdict=status, reason=f"did not land: {out.error}")
        if out.action != "complete":
            return LoadResult(ok=False, verdict=status, reason=f"kvferry policy says {out.action}")
        log.info("kvferry: load of request %s (transfer %s) %s: %d bytes, transfer %.4f s, checksum %.4f s",
                 spec.request_id, src.transfer_id, status, out.bytes, out.transfer_seconds, out.checksum_seconds)
        return LoadResult(ok=True, verdict=status)

    def shutdown(self) -> None:
        """Stops the publish thread (waits for a publish in flight), then the producer."""
        # kvferry.Producer.shutdown waits for its lock with the GIL held while a publish on
        # another thread holds that lock and needs the GIL to return: never overlap them.
        self._publish_pool.shutdown(wait=True, cancel_futures=True)
        if self.producer is not None:
            try:
                self.producer.shutdown()
            except Exception as e:  # shutting down: nothing left to protect
                log.warning("kvferry: producer shutdown: %s", e)

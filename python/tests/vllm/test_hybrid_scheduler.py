"""The scheduler side with several KV cache groups (vLLM's hybrid KV cache manager) and with
different block sizes on the two instances, without an engine: per-group tables (vLLM's null
block as None, each group cut at its own block size), the producer's block sizes in its reply,
and a consumer that refuses, before any byte moves, a producer whose block sizes it could not
verify against. Requests and blocks are duck-typed vLLM objects."""

import importlib.util
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run scripts/vllm-tests.sh", allow_module_level=True)

from kvferry.vllm import params as P
from kvferry.vllm.groups import block_size_refusal
from kvferry.vllm.scheduler import KvferrySchedulerSide, SchedulerConfig
from kvferry.vllm.worker import KvferryWorkerSide, LoadResult
from kvferry.vllm.metadata import KvferryConnectorMetadata, LoadOrder

Status = Enum("Status", ["FINISHED_LENGTH_CAPPED"])


@dataclass
class Req:
    request_id: str
    kv_transfer_params: dict[str, Any]
    prompt_token_ids: list[int] = field(default_factory=lambda: list(range(75)))
    status: Status = Status.FINISHED_LENGTH_CAPPED


@dataclass
class Block:
    block_id: int
    block_hash: Any = None

    @property
    def is_null(self):
        return self.block_id == 0


@dataclass
class Blocks:
    blocks: tuple


def side(producer: bool, sizes=(32, 32)) -> KvferrySchedulerSide:
    return KvferrySchedulerSide(SchedulerConfig(
        engine_id="e", is_producer=producer, is_consumer=not producer, host="127.0.0.1", port=17500, tp_size=1,
        pp_size=1, block_size=sizes[0], lease_seconds=30.0, group_block_sizes=tuple(sizes),
        allowed_producers=P.ProducerAllowlist.parse(["127.0.0.1"])))


def test_a_producer_sends_each_groups_table_with_null_blocks_and_its_block_sizes():
    # Group 0 sliding window (its first block freed: vLLM's null block 0), group 1 full attention;
    # 75 prompt tokens in blocks of 32: 3 positions, the sampled token's 4th block not sent.
    keep, kvp = side(True).request_finished(Req("r", {"do_remote_decode": True, "transfer_id": "t"}),
                                            ([0, 7, 9, 11], [3, 4, 5, 6]))
    assert keep
    assert kvp["remote_block_ids"] == [[None, 7, 9], [3, 4, 5]]
    assert kvp["remote_block_sizes"] == [32, 32]
    src = P.remote_source(kvp)
    assert src.remote_block_ids == ((None, 7, 9), (3, 4, 5)) and src.block_sizes == (32, 32)


def test_a_producer_with_another_group_count_than_its_config_keeps_nothing():
    assert side(True).request_finished(Req("r", {"do_remote_decode": True, "transfer_id": "t"}),
                                       ([3, 4, 5],)) == (False, None)


def test_a_consumer_loads_each_groups_positions_leaving_null_and_prefix_hit_blocks_out():
    s = side(False)
    kvp = P.producer_reply("t", "p", "127.0.0.1", 17600, 1, 1, [[None, 7, 9], [3, 4, 5]], "k", block_sizes=[32, 32])
    req = Req("r", kvp)
    assert s.get_num_new_matched_tokens(req, 0) == (75, True)
    blocks = Blocks(([Block(0), Block(12), Block(13)], [Block(20, block_hash="h"), Block(21), Block(22)]))
    s.update_state_after_alloc(req, blocks, 75)
    (load,) = s.build_connector_meta().loads
    assert load.block_ids == ((None, 12, 13), (None, 21, 22))
    assert load.source.block_sizes == (32, 32) and load.num_tokens == 75


@pytest.mark.parametrize("remote, local, windows, tokens, computed, why", [
    ((16, 32), (16, 32), (32, None), 75, 0, None),
    ((16,), (32,), (None,), 75, 0, None),
    ((32,), (16,), (None,), 75, 0, None),
    ((32,), (16,), (None,), 75, 64, None),
    ((16, 16), (16,), (None,), 75, 0, "2 KV cache groups, this instance 1"),
    ((48,), (32,), (None,), 75, 0, "not multiples of each other"),
    ((32,), (16,), (None,), 75, 16, "after a local prefix hit of 16 tokens the first checksummed block of 16 "
                                    "tokens starts at token 16,"),
    # Sliding window 32 at consumer blocks of 32, producer blocks of 64: the window's checksum
    # keeps positions [1, 3) of a 75-token prompt (token 32 on, inside producer block 0);
    # a 32-token prompt is one block.
    ((16, 64), (16, 32), (None, 32), 75, 0, "group 1: after the sliding window (32 tokens) the first checksummed "
                                            "block of 32 tokens starts at token 32"),
    ((16, 64), (16, 32), (None, 32), 32, 0, None),
    # Consumer blocks larger than the producer's: always aligned.
    ((16, 32), (16, 64), (None, 32), 75, 0, None),
])
def test_block_sizes_are_refused_only_where_the_load_could_not_be_verified(remote, local, windows, tokens, computed,
                                                                           why):
    got = block_size_refusal(remote, local, windows, tokens, computed)
    assert got is None if why is None else why in got, got


def test_a_consumer_computes_locally_when_the_producers_block_size_does_not_divide_its_own():
    s = side(False, sizes=(32,))
    kvp = P.producer_reply("t", "p", "127.0.0.1", 17600, 1, 1, [[1, 2, 3, 4]], "k", block_sizes=[24])
    assert s.get_num_new_matched_tokens(Req("r", kvp), 0) == (0, False)
    kvp = P.producer_reply("t", "p", "127.0.0.1", 17600, 1, 1, [[1, 2, 3, 4, 5]], "k", block_sizes=[16])
    assert s.get_num_new_matched_tokens(Req("r", kvp), 0) == (75, True)


@pytest.mark.parametrize("value, text", [
    ([32], "list of 2 block sizes"),
    ([32, 0], "list of 2 block sizes"),
    ([32, True], "list of 2 block sizes"),
    ([32, 1 << 21], "list of 2 block sizes"),
    ("32", "list of 2 block sizes"),
])
def test_bad_remote_block_sizes_are_refused(value, text):
    kvp = P.producer_reply("t", "p", "127.0.0.1", 17600, 1, 1, [[1], [2]], "k")
    kvp[P.REMOTE_BLOCK_SIZES] = value
    with pytest.raises(P.ParamsError, match=text):
        P.remote_source(kvp)


class FailingTransport:
    def register(self, kv_caches):
        pass

    def serve(self, send, on_publish=None):
        pass

    def released(self):
        return []

    def load(self, spec, deadline):
        return LoadResult(ok=False, verdict="mismatch", reason="flipped")

    def shutdown(self):
        pass


@pytest.mark.parametrize("report_blocks", [True, False])
def test_a_failed_load_is_reported_as_failed_and_its_blocks_only_with_one_group(report_blocks):
    worker = KvferryWorkerSide(0, 0, 5.0, FailingTransport(), report_blocks=report_blocks)
    src = P.remote_source(P.producer_reply("t", "p", "127.0.0.1", 17600, 1, 1, [[1, 2], [3, 4]], "k"))
    worker.start(KvferryConnectorMetadata(loads=[LoadOrder("r", src, ((None, 7), (8, 9)), 40)]))
    worker._pool.shutdown(wait=True)
    assert worker.transfer_results() == (set(), {"r"}, {"r"})
    assert worker.get_block_ids_with_load_errors() == ({7, 8, 9} if report_blocks else set())
    assert worker.transfer_results() == (set(), set(), set())


def test_a_rank_whose_cpu_kernel_packs_blocks_refuses_other_block_sizes_before_any_transfer():
    from kvferry.vllm.transport import KvferryTransport, TransportConfig

    t = KvferryTransport(TransportConfig(host="127.0.0.1", port=17700), tp_rank=0, pp_rank=0, tp_size=1, pp_size=1,
                         block_size=32, is_producer=False, is_consumer=True)
    try:
        t.packed_isa = "amx"
        t.consumers[(None, None)] = None  # no engine: the load must end before it needs one
        src = P.remote_source(P.producer_reply("t", "p", "127.0.0.1", 17600, 1, 1, [[1, 2]], "k", block_sizes=[64]))
        r = t.load(LoadOrder("r", src, ((4, 5, 6),), 75), deadline=0.0)
        assert not r.ok and "'amx' packs each block its own way" in r.reason
    finally:
        t.shutdown()


def state_side(producer: bool) -> KvferrySchedulerSide:
    # Group 0 Mamba-type state (one block of 256 tokens), group 1 full attention in blocks of 128.
    return KvferrySchedulerSide(SchedulerConfig(
        engine_id="e", is_producer=producer, is_consumer=not producer, host="127.0.0.1", port=17500, tp_size=1,
        pp_size=1, block_size=128, lease_seconds=30.0, group_block_sizes=(256, 128), group_states=(True, False),
        allowed_producers=P.ProducerAllowlist.parse(["127.0.0.1"])))


def test_a_producer_of_a_state_model_stops_one_token_short_of_the_prompt_once():
    s = state_side(True)
    callers = list(range(75))
    req = Req("r", {"do_remote_decode": True, "transfer_id": "t"}, prompt_token_ids=callers)
    req.num_prompt_tokens = 75
    s.on_new_request(req)
    assert len(req.prompt_token_ids) == 74 and req.num_prompt_tokens == 74
    assert len(callers) == 75  # the caller's prompt is left whole
    s.on_new_request(req)  # added again (a preemption): not cut twice
    assert len(req.prompt_token_ids) == 74
    keep, kvp = s.request_finished(req, ([5], [3]))
    assert keep and kvp["remote_block_ids"] == [[5], [3]] and kvp["remote_block_sizes"] == [256, 128]
    # Nothing is cut for a plain request, nor by a producer without state groups.
    plain = Req("p", {})
    s.on_new_request(plain)
    other = Req("o", {"do_remote_decode": True, "transfer_id": "u"})
    side(True).on_new_request(other)
    assert len(plain.prompt_token_ids) == len(other.prompt_token_ids) == 75


def test_a_consumer_of_a_state_model_loads_all_but_the_last_prompt_token():
    s = state_side(False)
    kvp = P.producer_reply("t", "p", "127.0.0.1", 17600, 1, 1, [[5], [3]], "k", block_sizes=[256, 128])
    req = Req("r", kvp)
    assert s.get_num_new_matched_tokens(req, 0) == (74, True)
    s.update_state_after_alloc(req, Blocks(([Block(9)], [Block(12)])), 74)
    (load,) = s.build_connector_meta().loads
    assert load.block_ids == ((9,), (12,)) and load.num_tokens == 74
    # A one-token prompt has nothing to load.
    one = Req("one", P.producer_reply("t1", "p", "127.0.0.1", 17600, 1, 1, [[5], [3]], "k", block_sizes=[256, 128]),
              prompt_token_ids=[7])
    assert s.get_num_new_matched_tokens(one, 0) == (0, False)

"""The KV cache layout tag (``remote_kv_layouts``): what decides how a block sits in memory beyond
its shape (on vLLM's CPU build, the attention kernel's ISA). A producer names its tag per KV
cache group; a consumer compares it with its own before any byte moves and refuses a mismatch as
a failed load (vLLM's ``kv_load_failure_policy`` decides), since a block packed one way and read
another would still verify. Without an engine: requests are duck-typed vLLM objects; the tags of
this host come from vLLM's own ISA choice."""

import importlib.util
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run scripts/vllm-tests.sh", allow_module_level=True)

import torch

from kvferry.vllm import params as P
from kvferry.vllm.groups import GroupInfo
from kvferry.vllm.layouts import kv_layout_tags
from kvferry.vllm.metadata import KvferryConnectorMetadata
from kvferry.vllm.scheduler import KvferrySchedulerSide, SchedulerConfig
from kvferry.vllm.worker import KvferryWorkerSide

VEC = "CPU_ATTN:vec:auto"
AMX = "CPU_ATTN:amx:auto"


def reply(tables=([3, 4, 5],), **over):
    r = P.producer_reply("t1", "e", "127.0.0.1", 17500, 1, 1, [list(t) for t in tables], "k" * 32)
    r.update(over)
    return r


@pytest.mark.parametrize("value,text", [
    ("CPU_ATTN:vec:auto", "must be a list of 1 layout tags"),
    ([VEC, VEC], "must be a list of 1 layout tags"),
    ([], "must be a list of 1 layout tags"),
    ([3], "3 is not a layout tag"),
    ([True], "True is not a layout tag"),
    ([""], "'' is not a layout tag"),
    (["x" * 65], "is not a layout tag"),
    (["x" * (10 << 20)], "is not a layout tag"),
    (["vec amx"], "is not a layout tag"),
    (["vec\n[kvferry] forged log line"], "is not a layout tag"),
    ([["vec"]], "is not a layout tag"),
])
def test_a_peers_layout_tags_are_bounded_typed_and_named_in_the_error(value, text):
    with pytest.raises(P.ParamsError, match=r"kv_transfer_params\['remote_kv_layouts'\].*" + text.replace("[", r"\[")):
        P.remote_source(reply(remote_kv_layouts=value))


def test_layout_tags_parse_per_group_with_nulls_and_are_sent_only_when_named():
    src = P.remote_source(reply(([1], [2]), remote_kv_layouts=[VEC, None]))
    assert src.kv_layouts == (VEC, None)
    assert P.remote_source(reply()).kv_layouts is None
    assert "remote_kv_layouts" not in P.producer_reply("t", "e", "h", 1, 1, 1, [[1]], "k", kv_layouts=[None])
    assert P.producer_reply("t", "e", "h", 1, 1, 1, [[1]], "k", kv_layouts=[AMX])["remote_kv_layouts"] == [AMX]


@pytest.mark.parametrize("remote,local,refused", [
    ((VEC,), (VEC,), None),
    ((VEC, None), (VEC, None), None),
    (None, (None,), None),                    # neither side names a tag: the shapes decide
    ((None,), (None,), None),
    ((AMX,), (VEC,), "group 0: the producer's KV cache layout is 'CPU_ATTN:amx:auto', this instance's "
                     "'CPU_ATTN:vec:auto'"),
    ((VEC, AMX), (VEC, VEC), "group 1"),
    (None, (VEC,), "the producer names no KV cache layout"),
    ((VEC,), (None,), "group 0: the producer's KV cache layout is 'CPU_ATTN:vec:auto', this instance's None"),
])
def test_layouts_must_be_equal_group_by_group_where_either_side_names_one(remote, local, refused):
    why = P.kv_layout_refusal(remote, local)
    assert (why is None) if refused is None else (refused in why), why


class Req:
    def __init__(self, request_id, kvp, n=75):
        self.request_id = request_id
        self.kv_transfer_params = kvp
        self.prompt_token_ids = list(range(n))


class Blocks:
    def __init__(self, ids):
        self.blocks = ([SimpleNamespace(block_id=b, block_hash=None, is_null=False) for b in ids],)


def consumer(tags=(VEC,)) -> KvferrySchedulerSide:
    return KvferrySchedulerSide(SchedulerConfig(
        engine_id="d", is_producer=False, is_consumer=True, host="127.0.0.1", port=17600, tp_size=1, pp_size=1,
        block_size=32, lease_seconds=30.0, group_block_sizes=(32,), group_kv_layouts=tags,
        allowed_producers=P.ProducerAllowlist.parse(["127.0.0.1"])))


class NoTransport:
    """A transport the refused load must never reach."""

    calls = 0
    refused = 0

    def record_refused(self):
        NoTransport.refused += 1

    def load(self, spec, deadline):
        NoTransport.calls += 1
        raise AssertionError("a refused load reached the transport")

    def released(self):
        return []

    def shutdown(self):
        pass


def test_a_producer_of_another_layout_is_refused_as_a_failed_load_that_never_reaches_the_transport():
    side = consumer()
    ok, other = Req("ok", reply(remote_kv_layouts=[VEC])), Req("other", reply(remote_kv_layouts=[AMX]))
    # Both are scheduled as loads (vLLM's kv_load_failure_policy decides the refused one's fate).
    assert side.get_num_new_matched_tokens(ok, 0) == (75, True)
    assert side.get_num_new_matched_tokens(other, 0) == (75, True)
    side.update_state_after_alloc(ok, Blocks([4, 5, 6]), 75)
    side.update_state_after_alloc(other, Blocks([7, 8, 9]), 75)
    meta = side.build_connector_meta()
    specs = {s.request_id: s for s in meta.loads}
    assert specs["ok"].refusal is None
    assert "'CPU_ATTN:amx:auto', this instance's 'CPU_ATTN:vec:auto'" in specs["other"].refusal
    worker = KvferryWorkerSide(0, 0, 5.0, NoTransport())
    worker.start(KvferryConnectorMetadata(loads=[specs["other"]]))
    worker._pool.shutdown(wait=True)
    assert (NoTransport.calls, NoTransport.refused) == (0, 1)
    assert worker.transfer_results() == (set(), {"other"}, {"other"})
    assert worker.get_block_ids_with_load_errors() == {7, 8, 9}


def test_a_producer_naming_no_layout_is_refused_by_a_cpu_consumer_and_taken_by_one_that_names_none():
    side = consumer()
    req = Req("r", reply())
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, Blocks([4, 5, 6]), 75)
    assert "names no KV cache layout" in side.build_connector_meta().loads[0].refusal
    side = consumer(tags=())
    req = Req("r", reply())
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, Blocks([4, 5, 6]), 75)
    assert side.build_connector_meta().loads[0].refusal is None


def test_a_producer_names_its_layout_tags_in_its_reply():
    side = KvferrySchedulerSide(SchedulerConfig(
        engine_id="p", is_producer=True, is_consumer=False, host="127.0.0.1", port=17600, tp_size=1, pp_size=1,
        block_size=32, lease_seconds=30.0, group_block_sizes=(32,), group_kv_layouts=(VEC,)))
    req = Req("r", {"do_remote_decode": True, "transfer_id": "t"})
    req.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    keep, kvp = side.request_finished(req, ([4, 5, 6],))
    assert keep and kvp["remote_kv_layouts"] == [VEC]


def vllm_config(dtype):
    return SimpleNamespace(model_config=SimpleNamespace(dtype=dtype), cache_config=SimpleNamespace(cache_dtype="auto"),
                           attention_config=SimpleNamespace(backend=None))


def test_this_hosts_tags_are_the_kernels_vllm_picks_per_group():
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    spec = SimpleNamespace(head_size=64, block_size=32)
    kv = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=["a"], kv_cache_spec=spec),
                                          SimpleNamespace(layer_names=["m"], kv_cache_spec=SimpleNamespace())])
    groups = [GroupInfo(0, ("a",), 32), GroupInfo(1, ("m",), 32, state=True)]
    for dtype in (torch.float32, torch.bfloat16):
        tags = kv_layout_tags(vllm_config(dtype), kv, groups)
        assert tags == (f"CPU_ATTN:{_get_attn_isa(dtype, 32, 64, 'auto')}:auto", None)
    # A head size of 16 * odd: vLLM's vec16 kernel whatever the host.
    spec.head_size = 80
    assert kv_layout_tags(vllm_config(torch.float32), kv, groups)[0] == "CPU_ATTN:vec16:auto"



def test_a_refused_load_counts_as_unverified_in_the_connectors_stats():
    from kvferry.vllm.transport import KvferryTransport, TransportConfig

    t = KvferryTransport(TransportConfig(host="127.0.0.1", port=17700), tp_rank=0, pp_rank=0, tp_size=1, pp_size=1,
                         block_size=32, is_producer=False, is_consumer=True)
    try:
        t.record_refused()
        stats = t.take_stats()
        assert stats["num_unverified"] == [1] and not stats["num_failed_transfers"] and not stats["num_verified"]
    finally:
        t.shutdown()

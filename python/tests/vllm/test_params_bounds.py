"""A request's ``kv_transfer_params`` come from whoever reaches the instance's API: the consumer
parses them bounded (sizes, types, ranges) and connects only to the producers it is configured
to trust (``allowed_producers``). Each case here passed parsing before these checks."""

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run scripts/vllm-tests.sh", allow_module_level=True)

from kvferry.vllm import params as P
from kvferry.vllm.scheduler import KvferrySchedulerSide, SchedulerConfig


def reply(**over):
    r = P.producer_reply("t1", "e", "10.0.0.5", 17500, 1, 1, [[3, 4, 5]], "k" * 32)
    r.update(over)
    return r


def test_a_producers_reply_parses():
    src = P.remote_source(reply())
    assert (src.host, src.port, src.remote_block_ids, src.load_key) == ("10.0.0.5", 17500, ((3, 4, 5),), "k" * 32)


@pytest.mark.parametrize("key,value,text", [
    (P.LOAD_KEY, "k" * (10 << 20), "more than 256 bytes"),
    (P.LOAD_KEY, "", "is empty"),
    (P.TRANSFER_ID, "t" * 5000, "more than 1024 bytes"),
    (P.REMOTE_ENGINE_ID, "e" * 5000, "more than 1024 bytes"),
    (P.REMOTE_HOST, "h" * 300, "more than 255 bytes"),
    (P.REMOTE_HOST, "evil host/x", "not a host name"),
    (P.REMOTE_BLOCK_IDS, [list(range(2_000_000))], "more than 1048576"),
    (P.REMOTE_BLOCK_IDS, [[3, 10**30]], "block id 1000000000000000000000000000000 is not an int"),
    (P.REMOTE_BLOCK_IDS, [[3, -1]], "is not an int"),
    (P.REMOTE_BLOCK_IDS, [[3, 4.0]], "is not an int"),
    (P.REMOTE_BLOCK_IDS, [[3, True]], "is not an int"),
    (P.REMOTE_BLOCK_IDS, [[1]] * 65, "block tables"),
    (P.REMOTE_BLOCK_IDS, [], "block tables"),
    (P.REMOTE_BLOCK_IDS, [(3, 4)], "lists of block ids"),
    (P.REMOTE_PORT, 0, "is not a TCP port"),
    (P.REMOTE_PORT, 65536, "is not a TCP port"),
    (P.REMOTE_PORT, True, "is bool, expected int"),
    (P.REMOTE_PORT, "17500", "is str, expected int"),
    (P.REMOTE_TP_SIZE, 0, "must be >= 1"),
    (P.REMOTE_BLOCK_SIZES, [0], "block sizes"),
    (P.REMOTE_BLOCK_SIZES, [1 << 21], "block sizes"),
    (P.REMOTE_BLOCK_SIZES, [True], "block sizes"),
    (P.REMOTE_BLOCK_SIZES, [16, 16], "block sizes"),
    (P.REMOTE_BLOCK_SIZES, "16", "block sizes"),
])
def test_sizes_types_and_ranges_are_bounded(key, value, text):
    with pytest.raises(P.ParamsError, match=text):
        P.remote_source(reply(**{key: value}))


def test_params_that_are_not_a_dict_are_refused_not_crashed_on():
    for bad in (["do_remote_prefill"], "x", 3):
        assert not P.wants_remote_prefill(bad) and not P.wants_remote_decode(bad)
        with pytest.raises(P.ParamsError, match="expected a dict"):
            P.remote_source(bad)


def test_the_allowlist_names_hosts_or_base_ports():
    allowed = P.ProducerAllowlist.parse(["10.0.0.5:17500", "prefill-1", "[fd00::1]:18000"])
    assert P.remote_source(reply(), allowed).host == "10.0.0.5"
    assert P.remote_source(reply(remote_host="PREFILL-1", remote_port=9000), allowed).port == 9000
    assert P.remote_source(reply(remote_host="fd00::1", remote_port=18000), allowed).port == 18000
    for host, port in [("10.0.0.5", 17501), ("10.0.0.6", 17500), ("evil.example", 80), ("fd00::1", 18001)]:
        with pytest.raises(P.ParamsError, match="not in allowed_producers"):
            P.remote_source(reply(remote_host=host, remote_port=port), allowed)
    for bad in ([], "10.0.0.5", ["h:port"], ["h:0"], [""], ["[fd00::1"], [3]):
        with pytest.raises(ValueError):
            P.ProducerAllowlist.parse(bad)


class Req:
    def __init__(self, request_id, kvp):
        self.request_id = request_id
        self.kv_transfer_params = kvp
        self.prompt_token_ids = list(range(40))


def test_a_consumer_computes_locally_what_an_unlisted_producer_would_send():
    s = KvferrySchedulerSide(SchedulerConfig(engine_id="d", is_producer=False, is_consumer=True, host="127.0.0.1",
                                             port=17600, tp_size=1, pp_size=1, block_size=16, lease_seconds=30.0,
                                             allowed_producers=P.ProducerAllowlist.parse(["10.0.0.5"])))
    assert s.get_num_new_matched_tokens(Req("ok", reply()), 0) == (40, True)
    assert s.get_num_new_matched_tokens(Req("evil", reply(remote_host="10.9.9.9")), 0) == (0, False)
    assert s.get_num_new_matched_tokens(Req("big", reply(load_key="k" * (10 << 20))), 0) == (0, False)


def test_without_an_allowlist_open_mode_loads_from_loopback_producers_only():
    loopback = P.producer_policy(None, None)
    assert isinstance(loopback, P.LoopbackOnly)
    for host in ("127.0.0.1", "127.3.2.1", "localhost", "::1", "[::1]"):
        assert P.remote_source(reply(remote_host=host), loopback).host == host
    for host in ("10.0.0.5", "evil.example", "0.0.0.0", "fd00::1", "127.0.0.1.evil.example"):
        with pytest.raises(P.ParamsError, match="not on this host"):
            P.remote_source(reply(remote_host=host), loopback)
    # secret mode: any producer, each proving the secret before it is sent a token or a key
    assert P.producer_policy(None, "/etc/kvferry/secret") is None
    # an allowlist is what it says, in either mode
    listed = P.producer_policy(["10.0.0.5"], None)
    assert P.remote_source(reply(), listed).host == "10.0.0.5"
    with pytest.raises(ValueError):
        P.producer_policy([], "/etc/kvferry/secret")


def test_an_open_mode_consumer_without_an_allowlist_computes_off_host_requests_locally():
    s = KvferrySchedulerSide(SchedulerConfig(engine_id="d", is_producer=False, is_consumer=True, host="127.0.0.1",
                                             port=17600, tp_size=1, pp_size=1, block_size=16, lease_seconds=30.0,
                                             allowed_producers=P.producer_policy(None, None)))
    assert s.get_num_new_matched_tokens(Req("local", reply(remote_host="127.0.0.1")), 0) == (40, True)
    assert s.get_num_new_matched_tokens(Req("far", reply()), 0) == (0, False)


@pytest.mark.parametrize("host,port,text", [
    ("10.0.0.5", 17500, "10.0.0.5:17500"),
    ("prefill-0", 1, "prefill-0:1"),
    ("::1", 17500, "[::1]:17500"),
    ("fe80::1%eth0", 2, "[fe80::1%eth0]:2"),
    ("[::1]", 17500, "[::1]:17500"),
])
def test_host_port_brackets_an_ipv6_address_once(host, port, text):
    assert P.host_port(host, port) == text

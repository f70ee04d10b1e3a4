"""kvferry.vllm.units (which KV heads each producer unit holds, which units a consumer rank loads)
and the ``remote_head_splits`` param: arithmetic only, no engines."""

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run scripts/vllm-tests.sh", allow_module_level=True)

from kvferry.vllm import params as P
from kvferry.vllm.units import (NO_HEAD_AXIS, ConfigError, PairingError, Unit, common_heads, consumer_units,
                                producer_units)


def units(tp_rank, tp_size, local_heads, producer_tp_size, producer_head_splits=1, pp_size=1, producer_pp_size=1):
    return consumer_units(tp_rank=tp_rank, tp_size=tp_size, pp_size=pp_size, local_heads=local_heads,
                          producer_tp_size=producer_tp_size, producer_pp_size=producer_pp_size,
                          producer_head_splits=producer_head_splits)


def test_equal_tp_with_one_unit_per_rank_is_one_whole_rank_load():
    for r in range(4):
        assert units(r, 4, 2, 4) == [Unit(r, 0, None)]


def test_a_larger_consumer_rank_loads_every_producer_rank_of_its_heads():
    # TP 2 -> TP 1, 2 KV heads: the one consumer rank loads a head from each producer rank.
    assert units(0, 1, 2, 2) == [Unit(0, 0, (0, 1)), Unit(1, 0, (1, 2))]
    # TP 4 -> TP 2, 8 KV heads: consumer rank 1 holds heads 4..7 = producer ranks 2 and 3.
    assert units(1, 2, 4, 4) == [Unit(2, 0, (4, 6)), Unit(3, 0, (6, 8))]


def test_a_smaller_consumer_rank_loads_the_units_of_its_heads():
    # TP 1 split in 2 -> TP 2: rank r loads unit r, which is its whole rank.
    assert [units(r, 2, 1, 1, 2) for r in (0, 1)] == [[Unit(0, 0, None)], [Unit(0, 1, None)]]
    # TP 1 split in 4 (8 heads) -> TP 2: rank 1 loads units 2 and 3.
    assert units(1, 2, 4, 1, 4) == [Unit(0, 2, (4, 6)), Unit(0, 3, (6, 8))]


def test_a_rank_that_is_not_a_union_of_whole_units_is_refused_naming_the_split_needed():
    with pytest.raises(PairingError, match=r"producer units hold 2 KV heads, this rank holds 1 .*head_splits 2"):
        units(1, 2, 1, 1)
    # 8 heads on TP 1 split in 2 (units of 4) -> TP 4 (2 heads a rank): needs head_splits 4.
    with pytest.raises(PairingError, match=r"units hold 4 KV heads, this rank holds 2 .*head_splits 4 "):
        units(0, 4, 2, 1, 2)
    # 6 heads: TP 2 (3 a rank) -> TP 3 (2 a rank): units of 1 head, head_splits 3.
    with pytest.raises(PairingError, match=r"head_splits 3 "):
        units(1, 3, 2, 2)
    assert units(1, 3, 2, 2, 3) == [Unit(0, 2, (2, 3)), Unit(1, 0, (3, 4))]


def test_other_pairings_are_refused_with_the_reason():
    with pytest.raises(PairingError, match="PP size 2 differs from this instance's 1"):
        units(0, 1, 2, 1, producer_pp_size=2)
    with pytest.raises(PairingError, match="do not split over the producer's TP size 3"):
        units(0, 1, 2, 3)
    with pytest.raises(PairingError, match="head_splits 4 does not divide its 2 KV heads"):
        units(0, 1, 2, 1, 4)


def test_mla_ranks_load_the_whole_latent_from_producer_rank_tp_mod_its_size():
    assert [units(r, 4, NO_HEAD_AXIS, 2) for r in range(4)] == [[Unit(r % 2, 0, None)] for r in range(4)]
    assert units(1, 2, NO_HEAD_AXIS, 4) == [Unit(1, 0, None)]
    with pytest.raises(PairingError, match="no head axis"):
        units(0, 2, NO_HEAD_AXIS, 1, 2)


def test_mixed_layouts_pair_only_equal_tp_without_splits():
    assert units(1, 2, None, 2) == [Unit(1, 0, None)]
    with pytest.raises(PairingError, match="do not share one KV head count"):
        units(0, 1, None, 2)


def test_common_heads():
    assert common_heads([2, 2]) == 2
    assert common_heads([None, None]) == NO_HEAD_AXIS
    assert common_heads([2, None]) is None
    assert common_heads([2, 4]) is None


def test_producer_units_split_the_ranks_heads_or_refuse():
    assert producer_units(1, 4, 1) == [None]
    assert producer_units(1, 4, 2) == [(4, 6), (6, 8)]
    for heads, splits, match in ((4, 3, "does not divide"), (4, 0, "must be >= 1"), (NO_HEAD_AXIS, 2, "no common"),
                                 (None, 2, "no common")):
        with pytest.raises(ConfigError, match=match):
            producer_units(0, heads, splits)


def test_remote_head_splits_param():
    reply = P.producer_reply("t", "e", "h", 17500, 2, 1, [[1]], "k")
    assert P.REMOTE_HEAD_SPLITS not in reply and P.remote_source(reply).head_splits == 1
    reply = P.producer_reply("t", "e", "h", 17500, 2, 1, [[1]], "k", head_splits=2)
    src = P.remote_source(reply)
    assert src.head_splits == 2
    # Unit j of rank (tp, pp): port + (pp * tp_size + tp) * head_splits + j.
    assert [src.unit_port(tp, 0, j) for tp in (0, 1) for j in (0, 1)] == [17500, 17501, 17502, 17503]
    for bad in (0, True, "2"):
        with pytest.raises(P.ParamsError, match="remote_head_splits"):
            P.remote_source({**reply, P.REMOTE_HEAD_SPLITS: bad})
    with pytest.raises(P.ParamsError, match="last unit port 65536"):
        P.remote_source({**reply, P.REMOTE_PORT: 65533})

"""kvferry.vllm.units (which KV heads and layers each producer unit holds, which units a consumer
rank loads) and the ``remote_head_splits`` / ``remote_layer_splits`` / ``remote_stage_layers``
params: arithmetic only, no engines."""

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run scripts/vllm-tests.sh", allow_module_level=True)

from kvferry.vllm import params as P
from kvferry.vllm import units as U
from kvferry.vllm.units import (NO_HEAD_AXIS, ConfigError, PairingError, Unit, common_heads, consumer_layer_units,
                                consumer_units, layer_number, layer_units, producer_units)


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
    with pytest.raises(PairingError, match=r"PP size 2, layer_splits 1\) did not send its stages' layer ranges"):
        units(0, 1, 2, 1, producer_pp_size=2)
    with pytest.raises(PairingError, match="do not split over the producer's TP size 3"):
        units(0, 1, 2, 3)
    with pytest.raises(PairingError, match="head_splits 4 does not divide its 2 KV heads"):
        units(0, 1, 2, 1, 4)


def test_mla_ranks_pair_only_at_equal_tp_one_rank_each():
    assert [units(r, 2, NO_HEAD_AXIS, 2) for r in range(2)] == [[Unit(r, 0, None)] for r in range(2)]
    # TP 2 -> TP 4 would have two consumer ranks load one producer lease (served once); TP 4 ->
    # TP 2 would leave producer ranks 2 and 3 unloaded: both refused, on every rank.
    for r, tc, tp in ((0, 4, 2), (3, 4, 2), (0, 2, 4), (1, 2, 4), (0, 2, 1)):
        with pytest.raises(PairingError, match=rf"same TP size \({tc}\), not {tp}: .*served once"):
            units(r, tc, NO_HEAD_AXIS, tp)
    with pytest.raises(PairingError, match="no head axis"):
        units(0, 2, NO_HEAD_AXIS, 2, 2)


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


def layers(pp_rank, pp_size, stage, producer_stages, layer_splits=1, numbers=None):
    return consumer_layer_units(pp_rank=pp_rank, pp_size=pp_size, stage_layers=stage,
                                layer_numbers=range(*stage) if numbers is None else numbers,
                                producer_pp_size=len(producer_stages), producer_stage_layers=producer_stages,
                                producer_layer_splits=layer_splits)


def test_layer_number_is_kvferrys():
    assert layer_number("model.layers.12.self_attn.attn") == 12
    assert layer_number("model.layers.x.attn") is None
    assert layer_number("model.layers.1.sub.2.attn") is None


def test_layer_units_split_a_stage_into_contiguous_runs_or_refuse():
    assert layer_units((0, 4), 1) == [(0, 4)]
    assert layer_units((0, 4), 2) == [(0, 2), (2, 4)]
    assert layer_units((3, 8), 2) == [(3, 5), (5, 8)]
    for splits, match in ((0, "must be >= 1"), (6, "exceeds the 5 layers")):
        with pytest.raises(ConfigError, match=match):
            layer_units((3, 8), splits)


def test_equal_pp_stages_are_one_whole_unit_with_or_without_the_producers_ranges():
    # No ranges sent (an older producer, or the tests' equal pairs): today's rule.
    assert consumer_layer_units(pp_rank=1, pp_size=2, stage_layers=None, layer_numbers=[2, 3], producer_pp_size=2,
                                producer_stage_layers=None, producer_layer_splits=1) == [(1, 0, None)]
    assert layers(1, 2, (2, 4), [(0, 2), (2, 4)]) == [(1, 0, None)]
    assert layers(0, 1, (0, 4), [(0, 4)]) == [(0, 0, None)]


def test_a_larger_consumer_stage_loads_every_producer_stage_of_its_layers():
    # PP 2 -> PP 1, 4 layers: both producer stages, each a layer range.
    assert layers(0, 1, (0, 4), [(0, 2), (2, 4)]) == [(0, 0, (0, 2)), (1, 0, (2, 4))]
    # PP 4 -> PP 2, 8 layers: consumer stage 1 holds 4..7 = producer stages 2 and 3.
    assert layers(1, 2, (4, 8), [(0, 2), (2, 4), (4, 6), (6, 8)]) == [(2, 0, (4, 6)), (3, 0, (6, 8))]


def test_a_smaller_consumer_stage_loads_the_layer_units_of_its_layers():
    # PP 1 split in 2 -> PP 2: stage s loads layer unit s, its whole stage.
    assert [layers(s, 2, st, [(0, 4)], 2) for s, st in ((0, (0, 2)), (1, (2, 4)))] == [[(0, 0, None)],
                                                                                       [(0, 1, None)]]
    # PP 1 split in 4 (8 layers) -> PP 2: stage 1 loads layer units 2 and 3.
    assert layers(1, 2, (4, 8), [(0, 8)], 4) == [(0, 2, (4, 6)), (0, 3, (6, 8))]


def test_a_stage_that_is_not_a_union_of_whole_layer_units_is_refused_naming_the_split_needed():
    with pytest.raises(PairingError, match=r"unit 0 holds layers \[0, 4\), this PP stage holds \[0, 2\).*"
                                           r"layer_splits 2 "):
        layers(0, 2, (0, 2), [(0, 4)])
    # 6 layers, PP 2 (3 each) -> PP 3 (2 each): layer_splits 2 splits [0, 3) at 1, not 2; 3 splits at 1, 2.
    with pytest.raises(PairingError, match=r"layer_splits 3 "):
        layers(1, 3, (2, 4), [(0, 3), (3, 6)], 2)
    assert layers(1, 3, (2, 4), [(0, 3), (3, 6)], 3) == [(0, 2, (2, 3)), (1, 0, (3, 4))]
    # vLLM's uneven partition: 5 layers on PP 2 = [0, 3) + [3, 5); a PP 1 producer of 5 layers
    # split in 2 ([0, 2) + [2, 5)) needs 3 ([0, 1) + [1, 3) + [3, 5)).
    with pytest.raises(PairingError, match=r"layer_splits 3 "):
        layers(0, 2, (0, 3), [(0, 5)], 2)
    assert layers(0, 2, (0, 3), [(0, 5)], 3) == [(0, 0, (0, 1)), (0, 1, (1, 3))]
    # A producer stage of one layer allows layer_splits 1 only, which does not split [1, 5) at 3.
    with pytest.raises(PairingError, match=r"no layer_splits of the producer aligns"):
        layers(0, 2, (0, 3), [(0, 1), (1, 5)])


def _layer_splits_needed_by_enumeration(stages, bounds):
    # The definition, quadratic: every unit edge of every stage at each candidate layer_splits.
    for r in range(1, min(b - a for a, b in stages) + 1):
        edges = {x for stage in stages for unit in layer_units(stage, r) for x in unit}
        if all(x in edges for x in bounds if any(a <= x <= b for a, b in stages)):
            return r
    return None


def test_the_layer_splits_search_matches_its_definition():
    cases = 0
    for total in range(1, 13):
        for cut in range(0, total):  # producer PP 1 ([0, total)) or 2 ([0, cut) + [cut, total))
            stages = [(0, total)] if cut == 0 else [(0, cut), (cut, total)]
            for c in range(0, total):
                for d in range(c + 1, total + 1):
                    assert U._layer_splits_needed(stages, (c, d)) == _layer_splits_needed_by_enumeration(
                        stages, (c, d)), (stages, c, d)
                    cases += 1
    assert cases > 1000


def test_the_layer_splits_search_at_the_largest_valid_size():
    # The most layers params accept: one producer stage of 2**16 layers; a consumer stage [0, 1)
    # needs units of one layer at the start: the smallest r with 2**16 // r == 1 is 2**15 + 1.
    with pytest.raises(PairingError, match=rf"start the producer with layer_splits {2**15 + 1} "):
        layers(0, 2, (0, 1), [(0, P.MAX_LAYERS)])
    # An edge at n - 1 needs (r - 1) * n // r == n - 1, so r = n: units of one layer.
    assert U._layer_splits_needed([(0, P.MAX_LAYERS)], (1, P.MAX_LAYERS - 1)) == P.MAX_LAYERS
    assert U._layer_splits_needed([(0, P.MAX_LAYERS)], (0, P.MAX_LAYERS // 2)) == 2
    assert U._layer_splits_needed([(0, 7), (7, P.MAX_LAYERS)], (0, 7)) == 1


def test_layers_outside_every_loaded_unit_are_refused():
    # The consumer holds a layer 4 (a draft layer, say) that the producer's stages do not.
    with pytest.raises(PairingError, match=r"layers \[4\] of this PP stage \[0, 4\) lie in no layer unit"):
        layers(0, 1, (0, 4), [(0, 2), (2, 4)], numbers=[0, 1, 2, 3, 4])
    # A layer without a number (or outside the range) is loaded only with the rank's whole KV.
    assert layers(0, 1, (0, 4), [(0, 4)], numbers=[0, None, 4]) == [(0, 0, None)]
    with pytest.raises(PairingError, match=r"no layer number"):
        layers(0, 1, (0, 4), [(0, 2), (2, 4)], numbers=[0, None])
    with pytest.raises(PairingError, match="do not fit its PP size 2 and layer_splits 3"):
        layers(0, 1, (0, 4), [(0, 2), (2, 4)], 3)
    with pytest.raises(PairingError, match="layer range is unknown"):
        consumer_layer_units(pp_rank=0, pp_size=1, stage_layers=None, layer_numbers=[0], producer_pp_size=2,
                             producer_stage_layers=[(0, 1), (1, 2)], producer_layer_splits=1)


def test_layer_units_compose_with_head_units():
    # Producer TP 2 x PP 2 (4 layers, 4 KV heads) -> consumer TP 1 x PP 1: 4 units, layer-major.
    got = consumer_units(tp_rank=0, tp_size=1, pp_size=1, local_heads=4, producer_tp_size=2, producer_pp_size=2,
                         producer_head_splits=1, stage_layers=(0, 4), layer_numbers=range(4),
                         producer_stage_layers=[(0, 2), (2, 4)])
    assert got == [Unit(0, 0, (0, 2), 0, 0, (0, 2)), Unit(1, 0, (2, 4), 0, 0, (0, 2)),
                   Unit(0, 0, (0, 2), 1, 0, (2, 4)), Unit(1, 0, (2, 4), 1, 0, (2, 4))]
    # Producer TP 1 x PP 1 split 2 x 2 -> consumer TP 2 x PP 2 rank (1, 1): one unit, its whole rank.
    got = consumer_units(tp_rank=1, tp_size=2, pp_size=2, pp_rank=1, local_heads=2, producer_tp_size=1,
                         producer_pp_size=1, producer_head_splits=2, stage_layers=(2, 4), layer_numbers=[2, 3],
                         producer_stage_layers=[(0, 4)], producer_layer_splits=2)
    assert got == [Unit(0, 1, None, 0, 1, None)]


def test_remote_layer_splits_and_stage_layers_params():
    reply = P.producer_reply("t", "e", "h", 17500, 2, 1, [[1]], "k", head_splits=2)
    assert P.REMOTE_LAYER_SPLITS not in reply and P.REMOTE_STAGE_LAYERS not in reply
    src = P.remote_source(reply)
    assert src.layer_splits == 1 and src.stage_layers is None
    reply = P.producer_reply("t", "e", "h", 17500, 2, 2, [[1]], "k", head_splits=2, layer_splits=3,
                             stage_layers=[(0, 4), (4, 8)])
    assert reply[P.REMOTE_STAGE_LAYERS] == [[0, 4], [4, 8]]
    src = P.remote_source(reply)
    assert src.layer_splits == 3 and src.stage_layers == ((0, 4), (4, 8))
    # Head unit j of layer unit k of rank (tp, pp): port + ((pp * tp_size + tp) * 3 + k) * 2 + j.
    assert src.unit_port(0, 0, 1, 0) == 17501 and src.unit_port(0, 0, 0, 2) == 17504
    assert src.unit_port(1, 0, 0, 0) == 17506 and src.unit_port(1, 1, 1, 2) == 17500 + 23
    for bad, match in ((0, "remote_layer_splits"), (True, "remote_layer_splits")):
        with pytest.raises(P.ParamsError, match=match):
            P.remote_source({**reply, P.REMOTE_LAYER_SPLITS: bad})
    for bad, match in (([[0, 4]], "list of 2"), ([[0, 4], [4, "8"]], "list of 2"), ([[0, 4], [5, 8]], "starts at 5"),
                       ([[0, 4], [4, 6]], "fewer layers than remote_layer_splits 3"), ("0-8", "list of 2")):
        with pytest.raises(P.ParamsError, match=match):
            P.remote_source({**reply, P.REMOTE_STAGE_LAYERS: bad})
    with pytest.raises(P.ParamsError, match="last unit port 65536"):
        P.remote_source({**reply, P.REMOTE_PORT: 65536 - 23})


def test_stage_layers_beyond_the_layer_bound_are_refused_by_params():
    # A peer's [[0, 10**9]] would otherwise reach the consumer's pairing arithmetic (units.py).
    reply = P.producer_reply("t", "e", "h", 17500, 1, 1, [[1]], "k", stage_layers=[(0, 4)])
    for bad in ([[0, 1_000_000_000]], [[P.MAX_LAYERS, P.MAX_LAYERS + 2]], [[0, P.MAX_LAYERS + 1]]):
        with pytest.raises(P.ParamsError, match=f"layer number above {P.MAX_LAYERS}"):
            P.remote_source({**reply, P.REMOTE_STAGE_LAYERS: bad})
    src = P.remote_source({**reply, P.REMOTE_STAGE_LAYERS: [[0, P.MAX_LAYERS]]})
    assert src.stage_layers == ((0, P.MAX_LAYERS),)
    two = P.producer_reply("t", "e", "h", 17500, 1, 2, [[1]], "k", stage_layers=[(0, 4), (4, P.MAX_LAYERS)])
    assert P.remote_source(two).stage_layers == ((0, 4), (4, P.MAX_LAYERS))

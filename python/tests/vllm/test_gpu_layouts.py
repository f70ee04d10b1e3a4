"""The CUDA layouts of vLLM 0.32 (NHD = LBNHC, HND = LBHNC, and the other KVCacheLayouts) through
kvferry.vllm.layouts and the transport, without a GPU.

The tensors MIRROR THE GPU PATH: they are made by vLLM's own ``allocate_kv_cache``
(``vllm/v1/worker/utils.py``, what ``gpu_model_runner.initialize_kv_cache_tensors`` calls and then
hands to ``register_kv_caches``) on the CPU device, with the strides vLLM's KV cache config gives
one group of layers (``compute_layout_strides``, as ``kv_cache_utils.get_kv_cache_config_from_groups``),
and K/V are written the way FlashAttention / Triton / FlashInfer split them
(``kv_cache.transpose(1, 2).split(head_size, dim=-1)``, flash_attn.py). Only the device differs,
so layouts.py is told ``device_type="cuda"`` (docs/vllm-connector-notes.md §10)."""

import functools
import importlib.util
import time

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run scripts/vllm-tests.sh", allow_module_level=True)

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    KVQuantMode,
    compute_layout_strides,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

import kvferry.checksum as kc
import kvferry.vllm.transport as transport_mod
from kvferry.vllm.layouts import LAYER_VIEW_ORDER, LAYOUT_ALIASES, LayoutError, layer_layout, layer_view
from kvferry.vllm.metadata import LoadOrder, SendOrder
from kvferry.vllm.params import RemoteSource
from kvferry.vllm.transport import KvferryTransport, TransportConfig

BLOCK, HEADS, D, NUM_BLOCKS = 16, 2, 64, 8
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=D, dtype=torch.bfloat16)
PORT = 17855
EXPECTED = {
    "LBNHC": "B N H KV D",
    "LBHNC": "B H N KV D",
    "LHBNC": "H B N KV D",
    "BLHNC": "B H N KV D",
    "BLNHC": "B N H KV D",
    "BHLNC": "B H N KV D",
}


def gpu_caches(layout_name, spec=SPEC, num_blocks=NUM_BLOCKS):
    """Layer name -> the ``[B, H, N, 2 * D]`` view vLLM 0.32 hands ``register_kv_caches`` on CUDA
    for one group of ``LAYERS`` under ``layout_name`` (zeros)."""
    layout = KVCacheLayout[LAYOUT_ALIASES.get(layout_name, layout_name)]
    layer_stride, block_stride, _, _, _ = compute_layout_strides(spec, num_blocks, len(LAYERS), layout)
    size = len(LAYERS) * num_blocks * spec.page_size_bytes
    cfg = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(size=size, layers=list(LAYERS), layer_stride=layer_stride,
                                        block_stride=block_stride)],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
        kv_cache_layout=layout.name,
    )
    return allocate_kv_cache(cfg, torch.device("cpu"), layout)


def k_and_v(t):
    """K and V caches ``[B, N, H, D]`` of a CUDA layer, split as vLLM's CUDA backends do."""
    return t.transpose(1, 2).split(t.shape[3] // 2, dim=-1)


def fill(kv, seed):
    """Writes the same random K and V (per layer, ``[B, N, H, D]``) through vLLM's split: the KV is
    the same whatever the layout."""
    g = torch.Generator().manual_seed(seed)
    for t in kv.values():
        k, v = k_and_v(t)
        k.copy_(torch.randn(k.shape, generator=g).to(k.dtype))
        v.copy_(torch.randn(v.shape, generator=g).to(v.dtype))
    return kv


def test_view_order_table_is_vllms():
    assert LAYER_VIEW_ORDER == {m.name: m.layer_view_order for m in KVCacheLayout}
    from vllm.config.cache import _LAYOUT_COMPAT_ALIASES
    assert LAYOUT_ALIASES == _LAYOUT_COMPAT_ALIASES


def test_nhd_and_hnd_tensors_are_what_notes_section_10_says():
    nhd, hnd = gpu_caches("NHD")[LAYERS[1]], gpu_caches("HND")[LAYERS[1]]
    c = 2 * D
    assert tuple(nhd.shape) == tuple(hnd.shape) == (NUM_BLOCKS, HEADS, BLOCK, c)
    assert nhd.dtype == hnd.dtype == torch.bfloat16
    assert nhd.stride() == (BLOCK * HEADS * c, c, HEADS * c, 1)
    assert hnd.stride() == (HEADS * BLOCK * c, BLOCK * c, c, 1)
    # Layer 1 starts one whole layer in (layer-outermost layouts).
    assert nhd.storage_offset() == NUM_BLOCKS * HEADS * BLOCK * c


@pytest.mark.parametrize("name", sorted(EXPECTED) + ["NHD", "HND"])
def test_each_vllm_layout_is_named_and_split_right(name):
    kv = fill(gpu_caches(name), seed=3)
    want = EXPECTED[LAYOUT_ALIASES.get(name, name)]
    for t in kv.values():
        lay = layer_layout(t, BLOCK, SPEC, name, device_type="cuda")
        assert (lay.layout, lay.kind) == (want, "FullAttentionSpec")
        axes = lay.layout.split()
        # Back to [B, N, H, KV, D]: KV 0 is vLLM's K, KV 1 its V, same memory.
        v = lay.view.permute(*(axes.index(a) for a in ("B", "N", "H", "KV", "D")))
        k, vv = k_and_v(t)
        assert v.data_ptr() == t.data_ptr()
        assert torch.equal(v[:, :, :, 0], k) and torch.equal(v[:, :, :, 1], vv)
        # The physical order: strides never increase along the named axes.
        steps = [lay.view.stride(i) for i, s in enumerate(lay.view.shape) if s > 1]
        assert steps == sorted(steps, reverse=True)


def test_without_the_layout_name_the_logical_order_is_used():
    t = gpu_caches("NHD")[LAYERS[0]]
    view, layout = layer_view(t, BLOCK, SPEC, device_type="cuda")
    assert layout == "B H N KV D" and tuple(view.shape) == (NUM_BLOCKS, HEADS, BLOCK, 2, D)


def test_strides_that_contradict_the_resolved_layout_are_refused():
    hnd = gpu_caches("HND")[LAYERS[0]]
    with pytest.raises(LayoutError, match="does not have vLLM's LBNHC layout"):
        layer_view(hnd, BLOCK, SPEC, "NHD", device_type="cuda")
    with pytest.raises(LayoutError, match="does not have vLLM's LBHNC layout"):
        layer_view(gpu_caches("NHD")[LAYERS[0]], BLOCK, SPEC, "HND", device_type="cuda")


def test_cpu_backend_takes_only_contiguous_lbhnc():
    nhd = gpu_caches("NHD")[LAYERS[0]]
    with pytest.raises(LayoutError, match="only a contiguous LBHNC"):
        layer_view(nhd, BLOCK, SPEC, "NHD")
    with pytest.raises(LayoutError, match="only a contiguous LBHNC"):
        layer_view(nhd, BLOCK, SPEC)
    view, layout = layer_view(gpu_caches("HND")[LAYERS[0]], BLOCK, SPEC, "HND")
    assert layout == "B H KV N D" and tuple(view.shape) == (NUM_BLOCKS, HEADS, 2, BLOCK, D)


@pytest.mark.parametrize("spec,match", [
    (FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=D, dtype=torch.bfloat16,
                       kv_quant_mode=KVQuantMode.NVFP4), "not a plain"),
    (FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=D, dtype=torch.bfloat16,
                       kv_quant_mode=KVQuantMode.FP8_PER_TOKEN_HEAD), "not a plain"),
    (FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=96, head_size_v=32,
                       dtype=torch.bfloat16), "not a plain"),
    (FullAttentionSpec(block_size=BLOCK, num_kv_heads=4, head_size=D, dtype=torch.bfloat16), "does not match"),
    (FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=32, dtype=torch.bfloat16), "does not match"),
])
def test_gpu_caches_that_are_not_plain_or_do_not_match_their_spec_are_refused(spec, match):
    with pytest.raises(LayoutError, match=match):
        layer_view(gpu_caches("NHD")[LAYERS[0]], BLOCK, spec, "NHD", device_type="cuda")


def test_one_head_gpu_cache_without_spec_is_ambiguous_and_unknown_layout_names_are_refused():
    one = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=D, dtype=torch.bfloat16)
    t = gpu_caches("NHD", spec=one)[LAYERS[0]]
    with pytest.raises(LayoutError, match="ambiguous"):
        layer_view(t, BLOCK, None, "NHD", device_type="cuda")
    assert layer_view(t, BLOCK, one, "NHD", device_type="cuda")[1] == "B N H KV D"
    with pytest.raises(LayoutError, match="unknown vLLM KV cache layout"):
        layer_view(t, BLOCK, one, "NDH", device_type="cuda")


def checksums(kv, name, blocks=(3, 0, 5), num_tokens=43):
    layers = []
    for lname, t in kv.items():
        lay = layer_layout(t, BLOCK, SPEC, name, device_type="cuda")
        layers.append(kc.KVCacheLayer(lname, lay.view, lay.layout, kind=lay.kind, dtype=str(t.dtype)))
    return kc.block_checksums(layers, list(blocks), num_tokens)


def test_same_kv_in_every_layout_has_the_same_checksum():
    # kvferry's checksum does not depend on the layout (docs/design.md §2.2): equal values for
    # the same KV prove the head, token and K/V axes were named right in each.
    want = checksums(fill(gpu_caches("NHD"), seed=5), "NHD")
    assert len(set(want)) == 3
    for name in sorted(EXPECTED) + ["HND"]:
        assert checksums(fill(gpu_caches(name), seed=5), name) == want, name
    # Misreading the HND tensor the CPU backend's way (K/V across tokens) changes the values.
    hnd = fill(gpu_caches("HND"), seed=5)
    wrong = [kc.KVCacheLayer(n, *layer_view(t, BLOCK, SPEC, "HND"), dtype=str(t.dtype)) for n, t in hnd.items()]
    assert kc.block_checksums(wrong, [3, 0, 5], 43) != want


@pytest.fixture
def pair(monkeypatch):
    # The transport's layers take the CUDA backends' K/V split, as on a GPU.
    monkeypatch.setattr(transport_mod, "layer_layout", functools.partial(layer_layout, device_type="cuda"))
    made = []

    def build(port, layout_name, **cfg):
        pkv, ckv = fill(gpu_caches(layout_name), seed=1), gpu_caches(layout_name)
        for role, kv, extra in (("p", pkv, {}), ("c", ckv, cfg)):
            t = KvferryTransport(TransportConfig(host="127.0.0.1", port=port, **extra), tp_rank=0, pp_rank=0,
                                 tp_size=1, pp_size=1, block_size=BLOCK, is_producer=role == "p",
                                 is_consumer=role == "c", kv_cache_specs={n: SPEC for n in LAYERS},
                                 kv_cache_layout=layout_name)
            made.append(t)
            t.register(kv)
        return made[-2], made[-1], pkv, ckv

    yield build
    for t in made:
        t.shutdown()


def send_and_load(producer, consumer, tid, port, num_tokens=43, remote=(3, 0, 5), local=(7, 2, 6)):
    producer.serve(SendOrder(request_id="p-" + tid, transfer_id=tid, block_ids=(remote,), num_tokens=num_tokens,
                            lease_seconds=10.0, load_key="k-" + tid))
    src = RemoteSource(transfer_id=tid, engine_id="e", host="127.0.0.1", port=port, tp_size=1, pp_size=1,
                       remote_block_ids=(remote,), load_key="k-" + tid)
    return consumer.load(LoadOrder(request_id="d-" + tid, source=src, block_ids=(local,), num_tokens=num_tokens),
                         time.monotonic() + 20)


@pytest.mark.parametrize("layout_name,port", [("NHD", PORT), ("HND", PORT + 10)])
def test_gpu_layout_load_lands_byte_equal_and_verified(pair, layout_name, port):
    p, c, pkv, ckv = pair(port, layout_name)
    assert p._views[LAYERS[0]][1] == EXPECTED[LAYOUT_ALIASES[layout_name]]
    r = send_and_load(p, c, "t0", port)
    assert r.ok and r.verdict == "verified", r
    for name in LAYERS:
        for i, (rb, lb) in enumerate(zip((3, 0, 5), (7, 2, 6))):
            n = min(BLOCK, 43 - i * BLOCK)
            for src, dst in zip(k_and_v(pkv[name]), k_and_v(ckv[name])):
                # Byte-equal: compare the raw bits, not the values.
                assert torch.equal(src[rb, :n].view(torch.int16), dst[lb, :n].view(torch.int16)), (name, rb)


@pytest.mark.parametrize("layout_name,port", [("NHD", PORT + 20), ("HND", PORT + 30)])
def test_gpu_layout_flipped_landed_bit_is_a_mismatch(pair, layout_name, port):
    p, c, _, _ = pair(port, layout_name, test_corrupt_transfer_prefix="bad-")
    r = send_and_load(p, c, "bad-0", port)
    assert not r.ok and r.verdict == "mismatch", r
    assert send_and_load(p, c, "good-0", port).verdict == "verified"

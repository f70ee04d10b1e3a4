"""kvferry.checksum on CPU tensors against an independent NumPy form of the definition, in every
layout; KVChecksumPayload byte-equal to the CLI's `kvferry payload encode`; compare and the
failure policy (docs/design.md §2.1-§2.7)."""

import json
import subprocess
import sys

import numpy as np
import pytest

import kvferry
from kvferry import checksum as kc

import kv_reference as ref

LAYOUTS = [
    "KV B N H D",  # vLLM FlashAttention
    "B KV N H D",  # FlashInfer
    "B KV H N D",  # HND
    "B H N KV D",  # fused
    "KV B H N D",
    "B N KV H D",
    "D H N KV B",  # D outermost: every cell gathered element by element
    "B N H D",  # one part (no KV), several heads
    "B N D",  # MLA: one part, one head
]
DTYPES = [np.uint8, np.float16, np.float32, np.float64]


def parts_heads(layout, heads):
    dims = layout.split()
    return (2 if "KV" in dims else 1), (heads if "H" in dims else 1)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_layout_and_element_size_matches_the_definition(layout, dtype):
    parts, heads = parts_heads(layout, 3)
    d = 16 // np.dtype(dtype).itemsize  # 16-byte rows: whole pieces for every element size
    kv = ref.logical_kv(6, 16, heads, parts, d, dtype, seed=hash((layout, np.dtype(dtype).name)) & 0xFFFF)
    tensor = ref.physical(kv, layout)
    layer = kc.KVCacheLayer("model.layers.7.self_attn.attn", tensor, layout, head_offset=5)
    assert (layer.num_blocks, layer.block_size, layer.heads) == (6, 16, heads)
    blocks = [4, 0, 5, 2]
    for num_tokens, start in [(64, 0), (53, 0), (70, 1), (16 * 5 + 1, 2)]:
        got = kc.block_checksums([layer], blocks, num_tokens, start=start)
        want = ref.block_checksums(kv, 7, 5, blocks, num_tokens, start=start)
        assert got == want, (num_tokens, start)
    assert any(got), "random KV checksums to something"


@pytest.mark.parametrize("layout", ["KV B N H D", "B KV H N D", "B N D"])
def test_kernel_blocks_split_a_logical_block(layout):
    parts, heads = parts_heads(layout, 2)
    kv = ref.logical_kv(4, 32, heads, parts, 8, np.float16, seed=3)
    layer = kc.KVCacheLayer("model.layers.2.attn", ref.physical(kv, layout, kernel_blocks=4), layout,
                            kernel_blocks=4)
    assert (layer.num_blocks, layer.block_size) == (4, 32)
    got = kc.block_checksums([layer], [3, 1], 50)
    assert got == ref.block_checksums(kv, 2, 0, [3, 1], 50)


def test_strided_views_read_in_place():
    # D padded to 12 in memory, B taken every other block: a view, not a copy.
    kv = ref.logical_kv(8, 16, 2, 2, 8, np.float16, seed=9)
    big = np.zeros((2, 16, 16, 2, 12), dtype=np.float16)
    view = big[:, ::2, :, :, :8]
    view[...] = ref.physical(kv, "KV B N H D")
    assert not view.flags.c_contiguous
    layer = kc.KVCacheLayer("model.layers.0.attn", view, "KV B N H D")
    assert layer.data_ptr == big.ctypes.data
    assert kc.block_checksums([layer], [7, 3], 30) == ref.block_checksums(kv, 0, 0, [7, 3], 30)


def test_a_size_one_axis_may_have_any_stride():
    # Exporters give a size-1 axis any stride (torch: often 0 or a neighbour's); it addresses
    # nothing, so it is no broadcast.
    kv = ref.logical_kv(3, 16, 1, 2, 8, np.float16, seed=6)
    a = ref.physical(kv, "KV B N H D")
    s = list(a.strides)
    s[3] = 0
    odd = np.lib.stride_tricks.as_strided(a, a.shape, s)
    layer = kc.KVCacheLayer("model.layers.3.attn", odd, "KV B N H D")
    assert kc.block_checksums([layer], [2, 0], 40) == ref.block_checksums(kv, 3, 0, [2, 0], 40)


def test_layers_sum_and_the_layer_number_comes_from_the_name():
    kvs = [ref.logical_kv(3, 16, 2, 2, 4, np.float32, seed=s) for s in (1, 2)]
    layers = [kc.KVCacheLayer(f"model.layers.{n}.self_attn.attn", ref.physical(kv, "KV B N H D"), "KV B N H D",
                              head_offset=2) for n, kv in zip((4, 11), kvs)]
    want = [(a + b) % 2**64 for a, b in zip(ref.block_checksums(kvs[0], 4, 2, [2, 0], 40),
                                            ref.block_checksums(kvs[1], 11, 2, [2, 0], 40))]
    assert kc.block_checksums(layers, [2, 0], 40) == want
    # The same KV under another layer number is another value.
    other = kc.KVCacheLayer("model.layers.5.self_attn.attn", layers[0].kv_cache, "KV B N H D", head_offset=2)
    assert kc.block_checksums([other], [2, 0], 40) != kc.block_checksums(layers[:1], [2, 0], 40)


class ArrayInterfaceOnly:
    """Offers only numpy's __array_interface__."""

    def __init__(self, a):
        self._a = a
        self.__array_interface__ = a.__array_interface__


class TorchLike:
    """Offers only torch's data_ptr()/shape/stride()/element_size()."""

    def __init__(self, a):
        self._a = a
        self.shape = a.shape
        self.is_cuda = False

    def data_ptr(self):
        return self._a.ctypes.data

    def stride(self):
        return tuple(s // self._a.itemsize for s in self._a.strides)

    def element_size(self):
        return self._a.itemsize


@pytest.mark.parametrize("wrap", [ArrayInterfaceOnly, TorchLike])
def test_every_tensor_interface_reads_the_same_bytes(wrap):
    kv = ref.logical_kv(4, 16, 2, 2, 8, np.float16, seed=5)
    base = np.zeros((4, 2, 2, 16, 10), dtype=np.float16)
    view = base[..., :8]  # strided: the interface's strides must be used
    view[...] = ref.physical(kv, "B KV H N D")
    layer = kc.KVCacheLayer("model.layers.1.attn", wrap(view), "B KV H N D")
    assert kc.block_checksums([layer], [1, 3], 60) == ref.block_checksums(kv, 1, 0, [1, 3], 60)


def test_the_python_layout_is_the_cli_spec_layout(tmp_path):
    cli = ref.kvferry_cli()
    if cli is None:
        pytest.skip("no kvferry binary and no cargo to build it")
    kv = ref.logical_kv(5, 16, 2, 2, 8, np.float16, seed=12)
    arr = ref.physical(kv, "B KV H N D")
    np.save(tmp_path / "l.npy", arr)
    spec = {"num_tokens": 70, "groups": [{"group_id": 0, "block_size": 16, "start": 1, "block_ids": [4, 0, 2, 3],
            "layers": [{"name": "model.layers.9.attn", "path": "l.npy", "layout": "B KV H N D",
                        "dims": {"B": 5, "N": 16, "H": 2, "D": 8}, "elem_bytes": 2, "head_offset": 4}]}]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = subprocess.run([cli, "checksum", "--spec", str(tmp_path / "spec.json")], capture_output=True,
                         text=True, check=True).stdout
    cli_values = [int(v, 16) for v in json.loads(out)["groups"][0]["values"]]
    layer = kc.KVCacheLayer("model.layers.9.attn", arr, "B KV H N D", head_offset=4)
    assert kc.block_checksums([layer], [4, 0, 2, 3], 70, start=1) == cli_values


def test_submit_returns_a_pending_value():
    kv = ref.logical_kv(2, 16, 1, 2, 4, np.float32, seed=4)
    layer = kc.KVCacheLayer("model.layers.0.attn", ref.physical(kv, "KV B N H D"), "KV B N H D")
    pending = kc.submit([layer], [1, 0], 32)
    assert pending.done()
    assert pending.wait() == ref.block_checksums(kv, 0, 0, [1, 0], 32)
    assert pending.wait() == ref.block_checksums(kv, 0, 0, [1, 0], 32), "a second wait returns the values again"


@pytest.mark.parametrize("make, match", [
    (lambda: kc.KVCacheLayer("model.layers.0.attn", np.zeros((2, 4, 16, 8)), "KV B N H D"), "names 5 axes"),
    (lambda: kc.KVCacheLayer("model.layers.0.attn", np.zeros((3, 4, 16, 1, 8)), "KV B N H D"), "KV axis has size 3"),
    (lambda: kc.KVCacheLayer("model.layers.0.attn", np.zeros((2, 4, 16, 1, 3), np.float16), "KV B N H D"),
     "not whole 8-byte pieces"),
    (lambda: kc.KVCacheLayer("model.layers.0.attn", np.zeros((2, 4, 16, 1, 8))[:, ::-1], "KV B N H D"),
     "negative stride"),
    (lambda: kc.KVCacheLayer("model.layers.0.attn", np.broadcast_to(np.zeros((1, 16, 1, 8)), (2, 4, 16, 1, 8)),
                             "KV B N H D"), "broadcast"),
    (lambda: kc.KVCacheLayer("model.layers.0.1.attn", np.zeros((2, 4, 16, 1, 8)), "KV B N H D"), "layer number"),
    (lambda: kc.KVCacheLayer("model.layers.0.attn", np.zeros((2, 4, 16, 1, 8)), "KV B N Q D"), "unknown dimension"),
    (lambda: kc.KVCacheLayer("model.layers.0.attn", np.zeros((2, 4, 16, 1, 8)), "KV B N H D", replicas=2,
                             replica_index=2), "replica_index"),
])
def test_bad_layers_are_refused_with_the_reason(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_not_a_tensor_is_a_type_error():
    with pytest.raises(TypeError, match="expected a tensor"):
        kc.KVCacheLayer("model.layers.0.attn", [1, 2, 3], "B N D")


def test_bad_checksum_calls_are_refused():
    a = kc.KVCacheLayer("model.layers.0.attn", np.zeros((2, 4, 16, 1, 8)), "KV B N H D")
    with pytest.raises(ValueError, match="block id 4 out of range"):
        kc.block_checksums([a], [0, 4], 32)
    b = kc.KVCacheLayer("model.layers.1.attn", np.zeros((2, 4, 16, 1, 8)), "KV B N H D", replicas=2, replica_index=1)
    with pytest.raises(ValueError, match="replica"):
        kc.block_checksums([a, b], [0], 16)
    c = kc.KVCacheLayer("model.layers.1.attn", np.zeros((2, 4, 32, 1, 8)), "KV B N H D")
    with pytest.raises(ValueError, match="block size"):
        kc.block_checksums([a, c], [0], 16)
    with pytest.raises(ValueError, match="no layers"):
        kc.block_checksums([], [0], 16)


def test_fingerprint_is_the_sha256_of_the_python_repr():
    import hashlib
    text = repr(("model.layers.0.attn", "FullAttentionSpec", 16, "torch.bfloat16"))
    want = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
    assert kc.layer_fingerprint("model.layers.0.attn", "FullAttentionSpec", 16, "torch.bfloat16") == want
    arr = np.zeros((2, 4, 16, 1, 8))
    layers = [kc.KVCacheLayer(f"model.layers.{i}.attn", arr, "KV B N H D", kind="FullAttentionSpec",
                              dtype="torch.bfloat16") for i in (0, 1)]
    assert kc.group_fingerprint(layers) == (want + kc.layer_fingerprint("model.layers.1.attn", "FullAttentionSpec", 16,
                                                                         "torch.bfloat16")) % 2**64
    assert kc.group_fingerprint([kc.KVCacheLayer("model.layers.0.attn", arr, "KV B N H D")]) is None


# --- payload -------------------------------------------------------------------------------

def sample_payload():
    return kc.KVChecksumPayload(40, [
        kc.KVChecksumGroup(0, [1, 2**64 - 1, 0x0123456789ABCDEF], block_size=16, start=0, fingerprint=0xFEEDFACE),
        kc.KVChecksumGroup(3, [7], block_size=32, start=2, fingerprint=0),
    ], tp_size=2)


def test_payload_round_trips():
    p = sample_payload()
    assert kc.KVChecksumPayload.from_bytes(p.to_bytes()) == p
    assert kc.KVChecksumPayload.from_bytes(bytearray(p.to_bytes())) == p
    assert kc.KVChecksumPayload.from_base64(p.to_base64()) == p
    assert kc.KVChecksumPayload.from_base64("  " + p.to_base64() + "\n") == p
    g = p.groups[0]
    assert (g.group_id, g.values, g.block_size, g.start, g.fingerprint) == (0, [1, 2**64 - 1, 0x0123456789ABCDEF], 16,
                                                                            0, 0xFEEDFACE)
    assert (p.version, p.tp_size, p.num_tokens) == (1, 2, 40)


def test_payload_wire_format_is_the_seeds():
    # msgpack [1, tp_size, num_tokens, [[group_id, fingerprint, block_size, start, bin8 of LE u64]]]
    p = kc.KVChecksumPayload(20, [kc.KVChecksumGroup(1, [5], block_size=16, start=0, fingerprint=9)], tp_size=1)
    assert p.to_bytes() == bytes([0x94, 1, 1, 20, 0x91, 0x95, 1, 9, 16, 0, 0xC4, 8, 5, 0, 0, 0, 0, 0, 0, 0])


def test_payload_bytes_equal_the_cli():
    cli = ref.kvferry_cli()
    if cli is None:
        pytest.skip("no kvferry binary and no cargo to build it")
    p = sample_payload()
    as_json = {"version": 1, "tp_size": p.tp_size, "num_tokens": p.num_tokens, "groups": [
        {"group_id": g.group_id, "fingerprint": f"0x{g.fingerprint:016x}", "block_size": g.block_size,
         "start": g.start, "values": [f"0x{v:016x}" for v in g.values]} for g in p.groups]}
    encoded = subprocess.run([cli, "payload", "encode"], input=json.dumps(as_json), capture_output=True, text=True,
                             check=True).stdout.strip()
    assert encoded == p.to_base64()
    decoded = subprocess.run([cli, "payload", "decode"], input=p.to_base64(), capture_output=True, text=True,
                             check=True).stdout
    assert json.loads(decoded) == as_json


@pytest.mark.parametrize("data, match", [
    (b"", "malformed"),
    (b"\x94\x02\x01\x14\x90", "version 2"),
    (bytes([0x94, 1, 1, 20, 0x91, 0x95, 1, 9, 16, 0, 0xC4, 7] + [0] * 7), "multiple of 8"),
    (bytes([0x94, 1, 1, 20, 0x91, 0x95, 1, 9, 0, 0, 0xC4, 0]), "block_size is 0"),
    (bytes([0x94, 1, 1, 20, 0x90, 0]), "trailing"),
    (bytes([0x94, 1, 1, 20, 0x91, 0x95, 1, 9, 16, 0, 0xC6, 0xFF, 0xFF, 0xFF, 0xF0]), "malformed"),
])
def test_bad_payload_bytes_raise_value_error(data, match):
    with pytest.raises(ValueError, match=match):
        kc.KVChecksumPayload.from_bytes(data)


def test_bad_groups_are_refused():
    with pytest.raises(ValueError, match="block_size must be at least 1"):
        kc.KVChecksumGroup(0, [1], block_size=0)
    with pytest.raises(OverflowError):
        kc.KVChecksumGroup(0, [2**64], block_size=16)
    twice = kc.KVChecksumPayload(16, [kc.KVChecksumGroup(0, [1], block_size=16)] * 2)
    with pytest.raises(ValueError, match="twice"):
        kc.compare(None, twice)


def test_bad_base64_raises_value_error():
    with pytest.raises(ValueError, match="base64"):
        kc.KVChecksumPayload.from_base64("not base64!")


# --- compare and policy --------------------------------------------------------------------

def consumer(values, start=0, num_tokens=40, block_size=16, group_id=0, fingerprint=0xFEEDFACE):
    return kc.KVChecksumPayload(num_tokens, [kc.KVChecksumGroup(group_id, values, block_size=block_size, start=start,
                                                                fingerprint=fingerprint)])


def producer():
    return kc.KVChecksumPayload(40, [kc.KVChecksumGroup(0, [11, 22, 33], block_size=16, fingerprint=0xFEEDFACE)])


def test_compare_verified_from_payload_bytes_and_text():
    for expected in (producer(), producer().to_bytes(), producer().to_base64()):
        v = kc.compare(expected, consumer([11, 22, 33]))
        assert (v.status, v.verified, v.mismatches, v.unverified) == ("verified", True, [], [])


def test_compare_reports_mismatching_positions():
    v = kc.compare(producer(), consumer([11, 99, 33]))
    assert (v.status, v.verified, v.mismatches) == ("mismatch", False, [(0, [1])])
    # A local prefix hit: the consumer compares from position 1 only.
    v = kc.compare(producer(), consumer([22, 34], start=1))
    assert v.mismatches == [(0, [2])]
    assert "group 0 differs at block positions [2]" in str(v)


def test_compare_unverified_reasons():
    assert kc.compare(None, consumer([11, 22, 33])).unverified == [(None, "no_checksums")]
    assert kc.compare(b"\x00garbage", consumer([11, 22, 33])).unverified == [(None, "invalid_checksums")]
    assert kc.compare("%%%", consumer([11, 22, 33])).unverified == [(None, "invalid_checksums")]
    assert kc.compare(producer(), consumer([11, 22, 33], group_id=1)).unverified == [(0, "one_side_only"),
                                                                                    (1, "one_side_only")]
    assert kc.compare(producer(), consumer([11, 22, 33], fingerprint=1)).unverified == [(0, "fingerprint_differs")]
    assert kc.compare(producer(), consumer([1, 2], block_size=24)).unverified == [(0, "block_sizes_incompatible")]
    with pytest.raises(TypeError):
        kc.compare(42, consumer([1]))


def test_compare_sums_smaller_blocks():
    # Consumer blocks of 8 tokens: two of them add up to one producer block of 16 (§2.1).
    v = kc.compare(kc.KVChecksumPayload(32, [kc.KVChecksumGroup(0, [10, 20], block_size=16)]),
                   kc.KVChecksumPayload(32, [kc.KVChecksumGroup(0, [4, 6, 15, 5], block_size=8)]))
    assert v.verified
    v = kc.compare(kc.KVChecksumPayload(32, [kc.KVChecksumGroup(0, [10, 20], block_size=16)]),
                   kc.KVChecksumPayload(32, [kc.KVChecksumGroup(0, [4, 6, 15, 6], block_size=8)]))
    assert v.mismatches == [(0, [2, 3])]


@pytest.mark.parametrize("fail_closed, policy, verified_action, bad_action", [
    (False, "fail", "complete", "complete"),
    (False, "recompute", "complete", "complete"),
    (True, "fail", "complete", "fail"),
    (True, "recompute", "complete", "recompute"),
])
def test_policy_decides_the_action(fail_closed, policy, verified_action, bad_action):
    ok = kc.compare(producer(), consumer([11, 22, 33]))
    mismatch = kc.compare(producer(), consumer([11, 22, 0]))
    unverified = kc.compare(None, consumer([11, 22, 33]))
    p = kc.KVChecksumPolicy(fail_closed, policy)
    assert p.decide(ok) == verified_action == kc.decide(ok, fail_closed, policy)
    assert p.decide(mismatch) == bad_action == kc.decide(mismatch, fail_closed=fail_closed,
                                                          load_failure_policy=policy)
    assert p.decide(unverified) == bad_action
    assert p.on_load_error() == policy


def test_policy_carrier_check_and_bad_names():
    assert kc.KVChecksumPolicy().check_carrier(True) is True
    assert kc.KVChecksumPolicy().check_carrier(False) is False
    with pytest.raises(ValueError, match="no checksum carrier"):
        kc.KVChecksumPolicy(fail_closed=True).check_carrier(False)
    with pytest.raises(ValueError, match="fail or recompute"):
        kc.KVChecksumPolicy(True, "retry")


def test_everything_public_has_a_docstring():
    names = [n for n in dir(kvferry) if not n.startswith("_")] + ["checksum." + n for n in kc.__all__]
    missing = []
    for n in names:
        obj = kvferry
        for part in n.split("."):
            obj = getattr(obj, part)
        if isinstance(obj, int):
            continue
        if not (obj.__doc__ or "").strip():
            missing.append(n)
        if isinstance(obj, type):
            for m, v in vars(obj).items():
                if not m.startswith("_") and callable(getattr(v, "__get__", None)) and not (v.__doc__ or "").strip():
                    missing.append(f"{n}.{m}")
    assert not missing, missing


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

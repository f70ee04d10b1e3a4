"""Runs one vLLM CPU engine (a tiny random-weight Qwen3 checkpoint written here, a DeepSeek-V2
one with MLA for the ``*-mla`` scenarios, a Llama-style hybrid of a sliding-window and a
full-attention layer for the ``*hyb*`` ones, or a Granite 4 hybrid of a Mamba2 and a
full-attention layer for the ``*mamba*`` ones; each kind in its own subdirectory of MODEL_DIR) in
this process and prints one JSON line of results. Driven by test_vllm_cpu*.py, one subprocess per
engine: vLLM keeps the KV connector and the distributed state as process globals.

    python engine_run.py SCENARIO MODEL_DIR RENDEZVOUS_DIR
    SCENARIO: producer-<name> or both-<name> of PRODUCERS | consumer-<name> of CONSUMERS
    (both-<name>: producer and consumer <name> in one engine, kv_both)

Producers and their consumers run at the same time and meet through files in RENDEZVOUS_DIR:
each consumer writes ``ready-<name>`` once started; a producer then prefills every prompt once
per consumer and kind (``do_remote_decode``, transfer ids ``<name>-ok-<tag><i>`` and
``<name>-corrupt-<tag><i>``, ``tag`` the producer's) and writes the returned
``kv_transfer_params`` to ``params-<producer scenario>.json``; each consumer decodes with the
params of each of its producers as they appear (the ``corrupt`` loads get a landed bit flipped by
the connector's test hook) and writes ``done-<name>``; the producers then check that their held
blocks were freed.
"""

import json
import os
import sys
import time

# The engine core in this process, so the scheduler's block pool can be read.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# head_dim 64: the CPU attention kernels of vLLM 0.32 refuse head_dim 16; the CPU block size
# must be a multiple of 32.
TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "attention_bias": False,
}
# DeepSeek-V2 with MLA, as small as vLLM's CPU MLA backend allows (v1/attention/backends/mla/
# cpu_mla.py): its decode kernel takes only a latent of kv_lora_rank 512 + qk_rope_head_dim 64 =
# 576 and block_size 16. first_k_dense_replace = num_hidden_layers: dense MLPs, no MoE.
TINY_DSV2 = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 32, "qk_rope_head_dim": 64,
    "v_head_dim": 32, "vocab_size": 512, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "first_k_dense_replace": 2, "moe_layer_freq": 1, "n_routed_experts": 4,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "topk_method": "greedy",
    "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
    "norm_topk_prob": False, "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "attention_bias": False,
}
# A Llama-style hybrid: layer 0 sliding-window attention (window 32 tokens), layer 1 full
# attention. vLLM's hybrid KV cache manager gives each its own KV cache group (group 0 the
# sliding window, group 1 full attention), each with its own block table.
TINY_HYBRID = {
    **{k: v for k, v in TINY_QWEN3.items() if k not in ("architectures", "model_type")},
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "mlp_bias": False,
    "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 32,
}
# A Granite 4 hybrid: layer 0 Mamba2 (vLLM's MambaMixer2, whose CPU kernels are
# layers/mamba/ops/cpu), layer 1 full attention; dense shared MLPs, no experts. vLLM gives the
# Mamba layer a state group (MambaSpec, one state block per request) and picks both groups' block
# sizes itself (the attention page must hold a state: 128 and 256 tokens here).
TINY_MAMBA = {
    "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid", "hidden_size": 128,
    "intermediate_size": 256, "shared_intermediate_size": 256, "num_local_experts": 0, "num_experts_per_tok": 0,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
    "max_position_embeddings": 512, "layer_types": ["linear_attention", "full_attention"], "mamba_d_state": 16,
    "mamba_n_heads": 4, "mamba_d_head": 64, "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2,
    "mamba_chunk_size": 64, "mamba_conv_bias": True, "mamba_proj_bias": False, "position_embedding_type": "rope",
    "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "hidden_act": "silu", "attention_bias": False,
}
BLOCK_SIZE = 32
MLA_BLOCK_SIZE = 16
# Prompt lengths: under one block, exactly one block, several blocks with a partial tail.
PROMPTS = [list(range(3, 3 + n)) for n in (7, 32, 75)]
MAX_TOKENS = 8


def is_mla(scenario: str) -> bool:
    """The ``*-mla`` scenarios run the tiny DeepSeek-V2 (MLA)."""
    return scenario.endswith("mla")


def is_hybrid(scenario: str) -> bool:
    """The ``*hyb*`` scenarios run the tiny sliding-window + full-attention hybrid."""
    return "hyb" in scenario


def is_mamba(scenario: str) -> bool:
    """The ``*mamba*`` scenarios run the tiny Mamba2 + full-attention Granite 4 hybrid."""
    return "mamba" in scenario


def model_kind(scenario: str) -> str:
    if is_mamba(scenario):
        return "mamba"
    return "mla" if is_mla(scenario) else "hybrid" if is_hybrid(scenario) else "qwen3"


def mla_args(scenario: str) -> dict:
    """``make_llm`` arguments of the MLA engines: vLLM 0.32's CPU MLA output depends on the batch
    (one prompt alone and batched with others gives other tokens, docs/vllm-connector-notes.md
    §9), so one sequence at a time makes runs comparable. The reference backend (CPU_MLA) is
    asked for by name: where the CPU has AMX tiles vLLM prefers AMX_MLA, whose weight packing
    takes bf16, fp16 or int8 weights only, not this float32 model's."""
    if not is_mla(scenario):
        return {}
    return {"block_size": MLA_BLOCK_SIZE, "max_num_seqs": 1, "attention_backend": "CPU_MLA"}


def write_model(path: str, kind: str = "qwen3") -> None:
    """The tiny Qwen3's (``kind`` "qwen3"), DeepSeek-V2's ("mla") or hybrid's ("hybrid") config
    and a seeded random checkpoint (the same bytes in every process; written atomically, as
    engines start side by side)."""
    os.makedirs(path, exist_ok=True)
    config = {"qwen3": TINY_QWEN3, "mla": TINY_DSV2, "hybrid": TINY_HYBRID, "mamba": TINY_MAMBA}[kind]
    tmp = os.path.join(path, f"config.json.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(config, f)
    os.replace(tmp, os.path.join(path, "config.json"))
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)
    from safetensors.torch import save_file

    tmp = os.path.join(path, f"model.safetensors.{os.getpid()}.tmp")
    shapes = {"qwen3": qwen3_shapes, "mla": dsv2_shapes, "hybrid": hybrid_shapes, "mamba": mamba_shapes}[kind]()
    save_file(random_weights(shapes), tmp)
    os.replace(tmp, os.path.join(path, "model.safetensors"))


def qwen3_shapes() -> dict:
    """Hugging Face weight name -> shape of the unsharded tiny Qwen3."""
    c = TINY_QWEN3
    hidden, heads, kv, hd, inter = (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"],
                                    c["head_dim"], c["intermediate_size"])
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (c["vocab_size"], hidden)}
    for i in range(c["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        shapes.update({
            pre + "self_attn.q_proj.weight": (heads * hd, hidden), pre + "self_attn.k_proj.weight": (kv * hd, hidden),
            pre + "self_attn.v_proj.weight": (kv * hd, hidden), pre + "self_attn.o_proj.weight": (hidden, heads * hd),
            pre + "self_attn.q_norm.weight": (hd,), pre + "self_attn.k_norm.weight": (hd,),
            pre + "mlp.gate_proj.weight": (inter, hidden), pre + "mlp.up_proj.weight": (inter, hidden),
            pre + "mlp.down_proj.weight": (hidden, inter), pre + "input_layernorm.weight": (hidden,),
            pre + "post_attention_layernorm.weight": (hidden,),
        })
    return shapes


def hybrid_shapes() -> dict:
    """Hugging Face weight name -> shape of the tiny hybrid (Qwen3's, without q/k norms)."""
    return {k: v for k, v in qwen3_shapes().items() if "q_norm" not in k and "k_norm" not in k}


def mamba_shapes() -> dict:
    """Hugging Face weight name -> shape of the tiny Granite 4 hybrid, from transformers' own
    model class (built on the meta device: no memory, no initialisation)."""
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    config = GraniteMoeHybridConfig(**{k: v for k, v in TINY_MAMBA.items() if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        model = GraniteMoeHybridForCausalLM(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def dsv2_shapes() -> dict:
    """Hugging Face weight name -> shape of the tiny DeepSeek-V2 (MLA without q_lora, dense MLPs)."""
    c = TINY_DSV2
    hidden, heads, inter = c["hidden_size"], c["num_attention_heads"], c["intermediate_size"]
    lora, rope, nope, v = c["kv_lora_rank"], c["qk_rope_head_dim"], c["qk_nope_head_dim"], c["v_head_dim"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (c["vocab_size"], hidden)}
    for i in range(c["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        shapes.update({
            pre + "self_attn.q_proj.weight": (heads * (nope + rope), hidden),
            pre + "self_attn.kv_a_proj_with_mqa.weight": (lora + rope, hidden),
            pre + "self_attn.kv_a_layernorm.weight": (lora,),
            pre + "self_attn.kv_b_proj.weight": (heads * (nope + v), lora),
            pre + "self_attn.o_proj.weight": (hidden, heads * v),
            pre + "mlp.gate_proj.weight": (inter, hidden), pre + "mlp.up_proj.weight": (inter, hidden),
            pre + "mlp.down_proj.weight": (hidden, inter), pre + "input_layernorm.weight": (hidden,),
            pre + "post_attention_layernorm.weight": (hidden,),
        })
    return shapes


def random_weights(shapes: dict) -> dict:
    """Seeded N(0, 1/fan_in) weights of the unsharded model in Hugging Face names (norms 1).

    vLLM's dummy weights (uniform +-1e-3) make the next token a function of the last token
    alone, so a load that never happened would go unnoticed; O(1)-scale weights make the output
    depend on the prompt's KV. They are a checkpoint, not written into the loaded model, so that
    vLLM's own loaders shard them: the same model at every TP size (heterogeneous TP compares a
    TP 1 engine's output with a TP 2 engine's)."""
    import torch

    gen = torch.Generator().manual_seed(1234)
    out = {}
    for name, shape in sorted(shapes.items()):
        if "norm" in name:
            out[name] = torch.ones(shape)
        else:
            fan_in = shape[-1] if "embed" not in name else 1
            out[name] = (torch.randn(shape, generator=gen) / fan_in**0.5).contiguous()
    return out


PORT = 17555
LEASE_S = 15.0


def make_llm(model: str, role: str | None, policy: str = "fail", tp: int = 1, port: int = PORT,
             name: str | None = None, head_splits: int = 1, block_size: int = BLOCK_SIZE, max_num_seqs: int = 4,
             lease: float = LEASE_S, secret_file: str | None = None, log_stats: bool = False,
             attention_backend: str | None = None):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = None
    if role is not None:
        ktc = KVTransferConfig(
            kv_connector="KvferryConnector", kv_connector_module_path="kvferry.vllm",
            kv_role=role, kv_load_failure_policy=policy,
            kv_connector_extra_config={"host": "127.0.0.1", "port": port, "lease_seconds": lease,
                                       "load_timeout_seconds": 20.0, "fail_closed": True, "head_splits": head_splits,
                                       "test_corrupt_transfer_prefix": f"{name or policy}-corrupt-"},
        )
        if secret_file is not None:
            ktc.kv_connector_extra_config["secret_file"] = secret_file
    # Only where asked: other engines keep vLLM's own choice.
    backend = {"attention_config": {"backend": attention_backend}} if attention_backend else {}
    llm = LLM(model=model, load_format="safetensors", skip_tokenizer_init=True, dtype="float32",
              max_model_len=256, enforce_eager=True, seed=0, block_size=block_size,
              max_num_seqs=max_num_seqs, enable_prefix_caching=False, kv_transfer_config=ktc,
              tensor_parallel_size=tp, disable_log_stats=not log_stats, **backend)
    return llm


def kvferry_metrics(llm) -> dict:
    """The connector's metrics in vLLM's Prometheus registry (``vllm:kvferry_*``, as vLLM's
    /metrics serves them, fed by ``get_kv_connector_stats``): a counter's value, a histogram's
    count and sum (``<name>_sum``), each summed over label sets."""
    out: dict = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:kvferry_"):
            if hasattr(m, "count"):
                out[m.name] = out.get(m.name, 0) + m.count
                out[m.name + "_sum"] = out.get(m.name + "_sum", 0) + m.sum
            else:
                out[m.name] = out.get(m.name, 0) + m.value
    return out


def generate(llm, prompts, max_tokens, params=None):
    from vllm import SamplingParams

    sps = []
    for i in range(len(prompts)):
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        if params is not None:
            sp.extra_args = {"kv_transfer_params": params(i)}
        sps.append(sp)
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sps, use_tqdm=False)
    return [
        {"tokens": list(o.outputs[0].token_ids), "finish_reason": o.outputs[0].finish_reason,
         "kv_transfer_params": o.kv_transfer_params}
        for o in outs
    ]


def free_blocks(llm) -> int:
    core = llm.llm_engine.engine_core.engine_core
    return core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def fake_producer_reply(i: int) -> dict:
    # A producer no consumer can reach: port 1 on loopback.
    return {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": f"t{i}",
            "remote_engine_id": "producer-0", "remote_host": "127.0.0.1", "remote_port": 1,
            "remote_tp_size": 1, "remote_pp_size": 1, "remote_block_ids": [[1, 2, 3]],
            "remote_kv_layouts": ["CPU_ATTN:vec:auto"], "load_key": "no-such-lease"}


def wait_for(path: str, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise SystemExit(f"timed out waiting for {path}")
        time.sleep(0.2)


def touch(path: str, data: str = "") -> None:
    with open(path + ".tmp", "w") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


RENDEZVOUS_TIMEOUT_S = 840


# Consumers: name -> (kv_load_failure_policy, TP size). Their test hook flips a landed bit of
# every load of a transfer "<name>-corrupt-...".
CONSUMERS = {"recompute": ("recompute", 1), "fail": ("fail", 1), "tp2": ("recompute", 2), "tp1": ("recompute", 1),
             "mla": ("recompute", 1), "hyb-fail": ("fail", 1), "hyb-rc": ("recompute", 1), "mamba": ("fail", 1)}
# Producers: scenario -> (TP size, head_splits, base port, transfer id tag, consumer names).
PRODUCERS = {
    "producer": (1, 1, PORT, "", ("recompute", "fail")),
    "producer-tp2": (2, 1, PORT + 10, "", ("tp2", "tp1")),
    # Heterogeneous TP the other way: TP 1 split into 2 units, each TP 2 consumer rank loads one.
    "producer-split": (1, 2, PORT + 20, "s-", ("tp2",)),
    # The tiny DeepSeek-V2: MLA latent caches (test_vllm_cpu_mla.py).
    "producer-mla": (1, 1, PORT + 30, "", ("mla",)),
    # The tiny hybrid under vLLM's hybrid KV cache manager (test_vllm_cpu_hybrid.py), producers
    # of block sizes 32 and 64 serving consumers of 32 (fail) and 64 (recompute): every pairing
    # of equal and different block sizes.
    "both-hyb-fail": (1, 1, PORT + 40, "", ("hyb-fail", "hyb-rc")),
    "both-hyb-rc": (1, 1, PORT + 50, "w-", ("hyb-fail", "hyb-rc")),
    # The tiny Mamba2 + attention hybrid: one engine serving itself, a state group and a
    # full-attention group.
    "both-mamba": (1, 1, PORT + 60, "", ("mamba",)),
}
# --block-size of the scenarios whose block size is not BLOCK_SIZE (MLA's is MLA_BLOCK_SIZE).
BLOCK_SIZES = {"both-hyb-rc": 64, "hyb-rc": 64}
# The engines that are producer and consumer at once (``both-*``) load right after they publish,
# side by side: a lease that outlasts both consumers' loads on a shared 2-core machine, and no
# unclaimed transfers (their expiry is the other producers' test). A load the consumer refuses
# (64 -> 32, sliding window) is held until the lease ends: the engine waits for it.
HYBRID_LEASE_S = 60.0


def shares_engines(scenario: str) -> bool:
    """The hybrid and Mamba scenarios, whose engines are producer and consumer at once: no
    unclaimed transfers, no unreachable-producer run (the Qwen3 consumers' tests)."""
    return is_hybrid(scenario) or is_mamba(scenario)


def secret_path(rdv: str) -> str:
    """The shared secret of the run's secret-mode engines (the MLA pair): written by the test
    before any engine starts (test_vllm_cpu.py ``run_engines``)."""
    return os.path.join(rdv, "secret")


def engine_args(scenario: str, rdv: str) -> dict:
    """``make_llm`` arguments of a scenario beyond its role: MLA's (:func:`mla_args`, and secret
    mode: the MLA pair proves a shared secret to each other) or its block size."""
    if is_mla(scenario):
        return {**mla_args(scenario), "secret_file": secret_path(rdv)}
    if is_mamba(scenario):
        return {"block_size": None}  # vLLM aligns the attention and state pages itself
    return {"block_size": BLOCK_SIZES[scenario]} if scenario in BLOCK_SIZES else {}


def start_producer(llm, scenario: str, rdv: str, result: dict) -> None:
    """Producer: prefills every prompt once per consumer and kind for ``do_remote_decode`` and
    writes the params (``params-<scenario>.json``)."""
    _, _, _, tag, names = PRODUCERS[scenario]
    result["free_before"] = free_blocks(llm)
    for name in names:
        wait_for(os.path.join(rdv, f"ready-{name}"), RENDEZVOUS_TIMEOUT_S)
    tids = [f"{name}-{kind}-{tag}{i}" for name in names for kind in ("ok", "corrupt") for i in range(len(PROMPTS))]
    if not shares_engines(scenario):
        tids += [f"unclaimed-{i}" for i in range(len(PROMPTS))]
    prompts = [PROMPTS[int(t.rsplit("-", 1)[1])] for t in tids]
    outs = generate(llm, prompts, 1, lambda i: {"do_remote_decode": True, "transfer_id": tids[i]})
    result["prefill"] = dict(zip(tids, outs))
    # Offline, vLLM steps only while requests run: this step hands the held sends to the
    # workers, which publish them to kvferry (their lease starts there).
    generate(llm, [[5, 6, 7]], 1)
    result["free_held"] = free_blocks(llm)
    touch(os.path.join(rdv, f"params-{scenario}.json"),
          json.dumps({t: o["kv_transfer_params"] for t, o in zip(tids, outs)}))


def finish_producer(llm, scenario: str, rdv: str, result: dict, lease: float) -> None:
    """Producer: waits for its consumers, then for its held blocks to be freed."""
    for name in PRODUCERS[scenario][4]:
        wait_for(os.path.join(rdv, f"done-{name}"), RENDEZVOUS_TIMEOUT_S)
    # Served sends are released at once; the unclaimed ones when their lease expires.
    end = time.monotonic() + lease + 10
    while free_blocks(llm) != result["free_before"] and time.monotonic() < end:
        generate(llm, [[5, 6, 7]], 1)
        time.sleep(0.5)
    result["free_after_lease"] = free_blocks(llm)


def consumer_references(llm, name: str, rdv: str, result: dict) -> None:
    """Consumer: the plain runs its decodes are compared with, then ``ready-<name>``."""
    result["reference"] = generate(llm, PROMPTS, MAX_TOKENS)
    # Same last token, other context: outputs must differ, or equality proves nothing.
    result["reference_context_changed"] = generate(
        llm, [[t + 100 for t in p[:-1]] + p[-1:] for p in PROMPTS], MAX_TOKENS)
    if is_mla(name):
        # Without any connector: the prompt plus its first 4 reference tokens, prefilled, must
        # continue as the reference decoded (vLLM's prefill and decode paths agree).
        result["reference_continued"] = generate(
            llm, [p + r["tokens"][:4] for p, r in zip(PROMPTS, result["reference"])], MAX_TOKENS - 4)
    if not shares_engines(name):
        result["decode_unreachable"] = generate(llm, PROMPTS, MAX_TOKENS, fake_producer_reply)
    touch(os.path.join(rdv, f"ready-{name}"))


# Consumers that first decode each "ok" transfer of the first producer with the producer's KV
# cache layout tags rewritten to another CPU attention kernel's (what a producer on a host with
# AMX tiles running bf16 names; this host's vLLM picks one kernel per model, so the tag is
# rewritten on its way, as a proxy could): refused before any byte moves, the lease untouched,
# so the same transfers then load and verify.
OTHER_LAYOUT_CONSUMERS = ("fail",)
OTHER_LAYOUT = "CPU_ATTN:amx:auto"


def other_layout(params: dict) -> dict:
    """A copy of a producer's params naming OTHER_LAYOUT for every group it names a tag for."""
    tags = params.get("remote_kv_layouts") or [None] * len(params["remote_block_ids"])
    return {**params, "remote_kv_layouts": [OTHER_LAYOUT if t is not None else None for t in tags]}


def consumer_decodes(llm, name: str, rdv: str, result: dict) -> None:
    """Consumer: decodes with the params of each of its producers as they appear, then
    ``done-<name>``."""
    # This run's producers of this consumer, taken in the order their params appear (each
    # holds its blocks only for its lease).
    pending = {s: PRODUCERS[s][3] for s in PRODUCERS if name in PRODUCERS[s][4]}
    end = time.monotonic() + RENDEZVOUS_TIMEOUT_S
    try:
        while pending:
            ready = [s for s in pending if os.path.exists(os.path.join(rdv, f"params-{s}.json"))]
            if not ready:
                if time.monotonic() > end:
                    raise SystemExit(f"timed out waiting for the params of {sorted(pending)}")
                time.sleep(0.2)
                continue
            scenario, tag = ready[0], pending.pop(ready[0])
            with open(os.path.join(rdv, f"params-{scenario}.json")) as f:
                params = json.load(f)
            if name in OTHER_LAYOUT_CONSUMERS and scenario == "producer":
                result["decode_other_layout"] = generate(llm, PROMPTS, MAX_TOKENS,
                                                         lambda i: other_layout(params[f"{name}-ok-{i}"]))
            for kind in ("ok", "corrupt"):
                key = f"decode_{kind}" + (f"_{tag.rstrip('-')}" if tag else "")
                result[key] = generate(llm, PROMPTS, MAX_TOKENS,
                                       lambda i: params[f"{name}-{kind}-{tag}{i}"])
    finally:
        touch(os.path.join(rdv, f"done-{name}"))


def free_total(llm) -> int:
    return llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1


def run_producer(scenario: str, model: str, rdv: str, result: dict, t0: float) -> None:
    tp, head_splits, port, _, _ = PRODUCERS[scenario]
    lease = HYBRID_LEASE_S if shares_engines(scenario) else LEASE_S
    llm = make_llm(model, "kv_producer", tp=tp, port=port, head_splits=head_splits, lease=lease,
                   **engine_args(scenario, rdv))
    result["startup_s"] = time.monotonic() - t0
    result["reference"] = generate(llm, PROMPTS, MAX_TOKENS)
    start_producer(llm, scenario, rdv, result)
    finish_producer(llm, scenario, rdv, result, lease)


# Consumers that also record vLLM's stats: their connector metrics are checked.
STATS_CONSUMERS = ("recompute",)


def run_consumer(name: str, model: str, rdv: str, result: dict, t0: float) -> None:
    policy, tp = CONSUMERS[name]
    log_stats = name in STATS_CONSUMERS
    llm = make_llm(model, "kv_consumer", policy, tp=tp, name=name, log_stats=log_stats, **engine_args(name, rdv))
    result["startup_s"] = time.monotonic() - t0
    consumer_references(llm, name, rdv, result)
    consumer_decodes(llm, name, rdv, result)
    if log_stats:
        result["kvferry_metrics"] = kvferry_metrics(llm)
    result["free_after"] = free_blocks(llm)
    result["free_total"] = free_total(llm)


def run_both(scenario: str, model: str, rdv: str, result: dict, t0: float) -> None:
    """One engine as producer and consumer (``kv_both``): it serves its consumers, itself
    included (a load from its own producer endpoint over loopback), and loads from its
    producers; its blocks are all free again at the end."""
    name = scenario.removeprefix("both-")
    policy, tp = CONSUMERS[name]
    ptp, head_splits, port, _, _ = PRODUCERS[scenario]
    llm = make_llm(model, "kv_both", policy, tp=tp, port=port, name=name, head_splits=head_splits,
                   lease=HYBRID_LEASE_S, **engine_args(scenario, rdv))
    result["startup_s"] = time.monotonic() - t0
    consumer_references(llm, name, rdv, result)
    start_producer(llm, scenario, rdv, result)
    consumer_decodes(llm, name, rdv, result)
    finish_producer(llm, scenario, rdv, result, HYBRID_LEASE_S)
    result["free_after"] = free_blocks(llm)
    result["free_total"] = free_total(llm)


def main() -> None:
    scenario, model, rdv = sys.argv[1], sys.argv[2], sys.argv[3]
    # One directory per model kind: engines of several models may share one run.
    model = os.path.join(model, model_kind(scenario))
    write_model(model, model_kind(scenario))
    t0 = time.monotonic()
    result: dict = {"scenario": scenario}
    if scenario.startswith("both-"):
        run_both(scenario, model, rdv, result, t0)
    elif scenario in PRODUCERS:
        run_producer(scenario, model, rdv, result, t0)
    elif scenario.removeprefix("consumer-") in CONSUMERS:
        run_consumer(scenario.removeprefix("consumer-"), model, rdv, result, t0)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    result["total_s"] = time.monotonic() - t0
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

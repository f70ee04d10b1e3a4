"""Runs one vLLM CPU engine (tiny random-weight Qwen3 written here) in this process and prints
one JSON line of results. Driven by test_vllm_cpu.py, one subprocess per engine: vLLM keeps the KV
connector and the distributed state as process globals.

    python engine_run.py SCENARIO MODEL_DIR
    SCENARIO: producer | producer-tp2 | consumer-recompute | consumer-fail
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
BLOCK_SIZE = 32
# Prompt lengths: under one block, exactly one block, several blocks with a partial tail.
PROMPTS = [list(range(3, 3 + n)) for n in (7, 32, 75)]
MAX_TOKENS = 8


def write_model(path: str) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(TINY_QWEN3, f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)


def reinit_weights(model) -> None:
    """vLLM's dummy weights (uniform +-1e-3) make the next token a function of the last token
    alone, so a load that never happened would go unnoticed. Seeded O(1)-scale weights instead,
    identical in every process: the output depends on the prompt's KV.

    vLLM's CPU linear layers prepack their weight at load time (oneDNN or sgl-kernel, dropping
    `weight`: vllm/model_executor/layers/utils.py dispatch_cpu_unquantized_gemm), so each one gets
    a new weight and plain torch.nn.functional.linear."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(1234)

    def plain_linear(x, weight, bias):
        return F.linear(x, weight, bias)

    with torch.no_grad():
        for name, m in sorted(model.named_modules()):
            w = getattr(m, "weight", None)
            if not isinstance(w, torch.nn.Parameter):
                continue
            if "norm" in name:
                w.fill_(1.0)
                continue
            if hasattr(m, "cpu_linear") and hasattr(m, "output_size_per_partition"):
                shape = (m.output_size_per_partition, m.input_size_per_partition)
            else:
                shape = tuple(w.shape)
            fan_in = shape[-1] if "embed" not in name else 1
            m.weight = torch.nn.Parameter(torch.randn(shape, generator=gen) / fan_in**0.5, requires_grad=False)
            if hasattr(m, "cpu_linear"):
                m.cpu_linear = plain_linear


def make_llm(model: str, role: str | None, policy: str = "fail", tp: int = 1):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = None
    if role is not None:
        ktc = KVTransferConfig(
            kv_connector="KvferryConnector", kv_connector_module_path="kvferry.vllm",
            kv_role=role, kv_load_failure_policy=policy,
            kv_connector_extra_config={"host": "127.0.0.1", "port": 17555, "lease_seconds": 2.0,
                                       "load_timeout_seconds": 5.0},
        )
    llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, dtype="float32",
              max_model_len=256, enforce_eager=True, seed=0, block_size=BLOCK_SIZE,
              max_num_seqs=4, enable_prefix_caching=False, kv_transfer_config=ktc,
              tensor_parallel_size=tp)
    llm.apply_model(reinit_weights)
    return llm


def generate(llm, prompts, max_tokens, params=None):
    from vllm import SamplingParams

    sps = []
    for i in range(len(prompts)):
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        if params is not None:
            sp.extra_args = {"kv_transfer_params": params(i)}
        sps.append(sp)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
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
            "remote_tp_size": 1, "remote_pp_size": 1}


def main() -> None:
    scenario, model = sys.argv[1], sys.argv[2]
    write_model(model)
    t0 = time.monotonic()
    result: dict = {"scenario": scenario}
    if scenario == "producer":
        llm = make_llm(model, "kv_producer")
        result["startup_s"] = time.monotonic() - t0
        result["reference"] = generate(llm, PROMPTS, MAX_TOKENS)
        result["free_before"] = free_blocks(llm)
        result["prefill"] = generate(llm, PROMPTS, 1, lambda i: {"do_remote_decode": True, "transfer_id": f"t{i}"})
        # Offline, vLLM steps only while requests run: this step hands the held sends to the
        # worker (their lease starts there), the one after the sleep reports them expired.
        generate(llm, [[5, 6, 7]], 1)
        result["free_held"] = free_blocks(llm)
        time.sleep(2.5)  # past lease_seconds
        generate(llm, [[5, 6, 7]], 1)
        result["free_after_lease"] = free_blocks(llm)
    elif scenario == "producer-tp2":
        # Two worker processes, one TP rank each (1 of the 2 KV heads): each builds its own
        # connector; the reply names the producer's TP size.
        llm = make_llm(model, "kv_producer", tp=2)
        result["startup_s"] = time.monotonic() - t0
        result["prefill"] = generate(llm, PROMPTS[:1], 1, lambda i: {"do_remote_decode": True, "transfer_id": "tp2"})
    elif scenario in ("consumer-recompute", "consumer-fail"):
        llm = make_llm(model, "kv_consumer", scenario.removeprefix("consumer-"))
        result["startup_s"] = time.monotonic() - t0
        result["reference"] = generate(llm, PROMPTS, MAX_TOKENS)
        # Same last token, other context: outputs must differ, or equality proves nothing.
        result["reference_context_changed"] = generate(
            llm, [[t + 100 for t in p[:-1]] + p[-1:] for p in PROMPTS], MAX_TOKENS)
        result["decode"] = generate(llm, PROMPTS, MAX_TOKENS, fake_producer_reply)
        result["free_after"] = free_blocks(llm)
        result["free_total"] = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    result["total_s"] = time.monotonic() - t0
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

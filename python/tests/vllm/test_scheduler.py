"""kvferry.vllm.scheduler's producer side without an engine: requests are duck-typed vLLM
Requests (request_id, kv_transfer_params, prompt_token_ids, status)."""

import importlib.util
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run scripts/vllm-tests.sh", allow_module_level=True)

from kvferry.vllm.scheduler import KvferrySchedulerSide, SchedulerConfig

Status = Enum("Status", ["FINISHED_LENGTH_CAPPED", "FINISHED_ABORTED"])


@dataclass
class Req:
    request_id: str
    kv_transfer_params: dict[str, Any]
    prompt_token_ids: list[int] = field(default_factory=lambda: list(range(40)))
    status: Status = Status.FINISHED_LENGTH_CAPPED


def producer():
    return KvferrySchedulerSide(SchedulerConfig(engine_id="e", is_producer=True, is_consumer=False,
                                                host="127.0.0.1", port=17500, tp_size=1, pp_size=1,
                                                block_size=16, lease_seconds=30.0))


def test_a_finished_prefill_is_held_and_its_params_name_the_transfer():
    s = producer()
    keep, kvp = s.request_finished(Req("r1", {"do_remote_decode": True, "transfer_id": "t1"}), [[3, 4, 5, 6]])
    assert keep and kvp["transfer_id"] == "t1" and kvp["remote_block_ids"] == [[3, 4, 5]]
    assert s.held == {"r1": "t1"}


def test_a_duplicate_transfer_id_is_not_held_and_the_first_request_is_unaffected():
    s = producer()
    assert s.request_finished(Req("r1", {"do_remote_decode": True, "transfer_id": "t1"}), [[3, 4, 5]])[0]
    assert s.request_finished(Req("r2", {"do_remote_decode": True, "transfer_id": "t1"}), [[7, 8, 9]]) == (False, None)
    assert s.held == {"r1": "t1"}
    meta = s.build_connector_meta()
    assert [(x.request_id, x.transfer_id, x.block_ids) for x in meta.sends] == [("r1", "t1", ((3, 4, 5),))]
    # Once the first is released, the id may be used again.
    s.update_connector_output({"r1"})
    assert s.request_finished(Req("r3", {"do_remote_decode": True, "transfer_id": "t1"}), [[1, 2, 3]])[0]
    assert s.held == {"r3": "t1"}

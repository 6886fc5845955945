"""`--dtype bfloat16` end to end on CPU: the three services serve a generation and a
session turn whose state went to disk (hibernate and spill: a blob of bf16 KV and conv
state, float32 SSM state) and came back (load and restore), each output equal to the
in-process runtime's in bf16, and the ledger stays clean."""

from __future__ import annotations

import json

import numpy as np

from custody.inprocess import InProcess
from services.executor.tiers.blob_store import PREFIX
from services.scheduler.records.request import Request
from services.scheduler.records.sampling import SamplingParams
from shared.config import Settings
from tests.services_harness import POOLS, call, ledger_when_idle, stack_settings, start_stack

FIRST = np.random.default_rng(7).integers(3, 250, size=40).tolist()
MORE = np.random.default_rng(8).integers(3, 250, size=6).tolist()
OUT = 6


def generate(port: int, tokens: list[int], sid: str | None = None) -> dict:
    body: dict = {
        "input_ids": tokens,
        "sampling_params": {"max_new_tokens": OUT, "ignore_eos": True},
    }
    if sid is not None:
        body["session_params"] = {"id": sid}
    return call(port, "/generate", body)


def in_process(prompt: list[int]) -> list[int]:
    local = InProcess(Settings(**POOLS, dtype="bfloat16"))
    params = SamplingParams(max_new_tokens=OUT, ignore_eos=True)
    req = local.engine.submit(Request("r", np.asarray(prompt), params))
    local.run_until_idle()
    return req.output


def blob_dtypes(data: bytes) -> list[str]:
    _, _, _, header_len = PREFIX.unpack_from(data)
    header = json.loads(data[PREFIX.size : PREFIX.size + header_len])
    return [a["dtype"] for a in header["arrays"]]


def test_bfloat16_serves_a_generation_and_a_session_through_disk(redis_url, redis_client, tmp_path):
    state = tmp_path / "state"
    stack = start_stack(stack_settings(redis_url, dtype="bfloat16", state_dir=state))
    try:
        port = stack.settings.port
        assert generate(port, FIRST)["output_ids"] == in_process(FIRST)
        sid = call(port, "/open_session", {})
        first = generate(port, FIRST, sid)["output_ids"]
        placed = call(port, "/place_session", {"session_id": sid, "tier": "disk"})
        assert placed["tier"] == "disk"
        (blob,) = (state / "replica-0").glob("*.blob")
        assert blob_dtypes(blob.read_bytes()) == ["bfloat16"] * 3 + ["float32"]
        second = generate(port, MORE, sid)
        history = FIRST + first
        assert second["meta_info"]["cached_tokens"] >= len(history) - POOLS["page_size"]
        assert second["output_ids"] == in_process(history + MORE)
        call(port, "/close_session", {"session_id": sid})
        view = ledger_when_idle(stack)
        assert view["violations"] == [] and view["leaked"] == {}
    finally:
        stack.stop()

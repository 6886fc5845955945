"""Tier moves on real tensors (CPU): a session's state survives hibernate, spill, load and
restore bit for bit into other pages and slots; a blob that fails its check fails its
move alone; blobs are private and never half written; a bad move is refused before
anything changes; the runner runs a step of moves alone; the service answers with the
failed moves and marks a step's moves in Redis while they run."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY

from services.executor.model.pools import DevicePools, PoolSizes
from services.executor.refusal import BatchRefused
from services.executor.runner import ModelRunner
from services.executor.service import ExecutorService
from services.executor.tiers.blob_store import (
    BlobBadMagic,
    BlobChecksumMismatch,
    BlobMismatch,
    BlobMissing,
    BlobStore,
    BlobTruncated,
)
from services.executor.tiers.checks import TierMoveRefused
from services.executor.tiers.host_tier import HostTier
from services.executor.tiers.mover import TierMover
from services.executor.weights import builtin_model
from shared import streams
from shared.config import Settings
from shared.deferred_ops import DeferredOps
from shared.messages.envelope import I4, array, encode
from shared.messages.forward import Step, StepRow, decode_result
from shared.messages.tiers import TierMove
from shared.model_config import builtin_config
from shared.tiers import StateShapes, TierSizes

PAGE = 4
TOKENS = 10  # three pages, the last one part full
CFG = builtin_config()


def build(state_dir: Path, seed: int = 0) -> TierMover:
    """Device pools of random data, a zeroed host tier, a disk tier of 3 blobs."""
    device = DevicePools(CFG, PoolSizes(16, PAGE, 6), torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    for t in (device.k, device.v, device.conv, device.ssm):
        t.copy_(torch.randn(t.shape, generator=g))
    host = HostTier(CFG, TierSizes(12, 4, 3, StateShapes.of(CFG, PAGE)))
    for t in host.kv_tensors + host.state_tensors:
        t.zero_()
    return TierMover(device, host, BlobStore(state_dir, 3, PAGE), PAGE, context_len=48)


@pytest.fixture
def mover(tmp_path: Path) -> TierMover:
    return build(tmp_path / "state")


def positions(pages: list[int], tokens: int = TOKENS) -> torch.Tensor:
    return (torch.tensor(pages)[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)[:tokens]


def hibernate(pages=(2, 5, 7), slot=3, to=(4, 1, 9), to_slot=2, sid="s") -> TierMove:
    return TierMove.of("hibernate", sid, TOKENS, slot, to_slot, list(pages), list(to))


def spill(pages=(4, 1, 9), slot=2, disk=2, sid="s") -> TierMove:
    return TierMove.of("spill", sid, TOKENS, slot, disk, src_pages=list(pages))


def load(disk=2, to=(3, 6, 8), slot=4, sid="s", tokens=TOKENS) -> TierMove:
    return TierMove.of("load", sid, tokens, disk, slot, dst_pages=list(to))


def restore(pages=(3, 6, 8), slot=4, to=(10, 11, 1), to_slot=5, sid="s") -> TierMove:
    return TierMove.of("restore", sid, TOKENS, slot, to_slot, list(pages), list(to))


def snapshot(mover: TierMover) -> list[torch.Tensor]:
    d, h = mover.device, mover.host
    return [t.clone() for t in (d.k, d.v, d.conv, d.ssm, *h.kv_tensors, *h.state_tensors)]


def metric(name: str, kind: str | None = None) -> float:
    labels = {"kind": kind} if kind else {}
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_session_survives_every_tier_bit_for_bit_into_other_pages_and_slots(mover):
    device = mover.device
    src = positions([2, 5, 7])
    expected = [device.k[:, src].clone(), device.v[:, src].clone()]
    expected += [device.conv[:, 3].clone(), device.ssm[:, 3].clone()]
    assert mover.apply([hibernate()], []) == []
    assert mover.apply([spill()], []) == []
    for t in mover.host.kv_tensors + mover.host.state_tensors:
        t.fill_(float("nan"))  # what is restored can only come from the disk
    loads = metric("custody_tier_moves_total", "load")
    assert mover.apply([load()], []) == []
    assert metric("custody_tier_moves_total", "load") == loads + 1
    assert mover.apply([restore()], []) == []
    dst = positions([10, 11, 1])
    got = [device.k[:, dst], device.v[:, dst], device.conv[:, 5], device.ssm[:, 5]]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_a_hibernate_reads_a_device_slot_before_a_restore_of_the_same_step_writes_it(mover):
    """Moves run by kind, hibernates first, whatever their order in the step."""
    old = mover.device.ssm[:, 3].clone()
    mover.apply([hibernate(slot=3, to_slot=1, to=(4, 1, 9))], [])
    mover.host.ssm[:, 1] += 1
    incoming = mover.host.ssm[:, 1].clone()
    step = [
        restore(pages=(4, 1, 9), slot=1, to=(2, 5, 7), to_slot=3, sid="b"),
        hibernate(slot=3, to_slot=2, to=(3, 6, 8)),
    ]
    assert mover.apply(step, []) == []
    assert torch.equal(mover.host.ssm[:, 2], old)
    assert torch.equal(mover.device.ssm[:, 3], incoming)


def test_a_spill_reads_host_slots_before_a_hibernate_of_the_same_step_writes_them(mover):
    """The scheduler frees a spill's host slots at once; a hibernate may reuse them."""
    mover.apply([hibernate(slot=3, to_slot=2, to=(4, 1, 9))], [])
    spilled = mover.host.ssm[:, 2].clone()
    step = [hibernate(slot=5, to_slot=2, to=(4, 1, 9), sid="b"), spill(slot=2, disk=1)]
    assert mover.apply(step, []) == []
    assert torch.equal(mover.host.ssm[:, 2], mover.device.ssm[:, 5])
    mover.apply([load(disk=1, slot=4)], [])
    assert torch.equal(mover.host.ssm[:, 4], spilled)


@pytest.mark.parametrize(
    ("how", "sid", "tokens", "error"),
    [
        ("flip", "s", TOKENS, BlobChecksumMismatch),  # a bit of the payload
        ("magic", "s", TOKENS, BlobBadMagic),
        ("truncate", "s", TOKENS, BlobTruncated),
        ("delete", "s", TOKENS, BlobMissing),
        (None, "other", TOKENS, BlobMismatch),  # another session's blob
        (None, "s", TOKENS - 1, BlobMismatch),  # another length
    ],
)
def test_a_blob_that_fails_its_check_fails_its_move_alone(mover, how, sid, tokens, error):
    mover.apply([hibernate(), spill()], [])
    blob = mover.blobs.path(2)
    data = bytearray(blob.read_bytes())
    if how in ("flip", "magic"):
        data[len(data) // 2 if how == "flip" else 0] ^= 0x01
    blob.write_bytes(data[:-100] if how == "truncate" else data)
    if how == "delete":
        blob.unlink()
    with pytest.raises(error):
        mover.blobs.read(2, sid, tokens)
    failed = metric("custody_tier_failed_moves_total", "load")
    # the step's other move, a hibernate of another session, still runs
    other = hibernate(slot=4, to_slot=3, to=(10, 11, 12), sid="o")
    assert mover.apply([load(sid=sid, tokens=tokens), other], []) == [0]
    assert metric("custody_tier_failed_moves_total", "load") == failed + 1
    assert torch.equal(mover.host.ssm[:, 3], mover.device.ssm[:, 4])


def test_a_spill_the_disk_refuses_fails_alone_and_leaves_no_blob(mover, monkeypatch):
    mover.apply([hibernate()], [])

    def full(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    failed = metric("custody_tier_failed_moves_total", "spill")
    assert mover.apply([spill()], []) == [0]
    assert metric("custody_tier_failed_moves_total", "spill") == failed + 1
    assert list(mover.blobs.dir.iterdir()) == []


def test_blobs_are_private_whole_and_deleted_when_discarded(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    (state / "3.tmp").write_bytes(b"half a blob")
    (state / "1.blob").write_bytes(b"kept: the scheduler decides")
    mover = build(state)
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert sorted(p.name for p in state.iterdir()) == ["1.blob"]
    mover.apply([hibernate()], [])
    mover.apply([spill(disk=3)], [])
    assert stat.S_IMODE((state / "3.blob").stat().st_mode) == 0o600
    discards = metric("custody_tier_discards_total")
    assert mover.apply([], [3, 2]) == []
    assert metric("custody_tier_discards_total") == discards + 2
    assert sorted(p.name for p in state.iterdir()) == ["1.blob"]


def sunk(move: TierMove) -> TierMove:
    """Its destination on the sink (the wire refuses it; an in-process caller need not)."""
    if move.kind == "spill":
        move.dst_slot = 0
    else:
        move.dst_pages = array([5, 0, 6], I4)
    return move


@pytest.fixture(scope="module")
def model():
    return builtin_model()


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (hibernate(to=(5, 6, 13), sid="o"), "host pages outside 1..12"),
        (sunk(hibernate(to=(5, 6, 7), sid="o")), "host pages outside"),
        (hibernate(to=(5, 6, 7), to_slot=5, sid="o"), "host slot 5 outside 1..4"),
        (hibernate(pages=(2, 5), to=(5, 6), sid="o"), "2 device pages, its tokens need 3"),
        (hibernate(pages=(2, 2, 7), to=(5, 6, 7), sid="o"), "device page named twice"),
        (spill(pages=(10, 11, 12), slot=1, disk=4), "disk slot 4 outside 1..3"),
        (sunk(spill(pages=(10, 11, 12), slot=1)), "disk slot 0 outside"),
        (restore(to=(10, 11, 17)), "device pages outside 1..16"),
        (TierMove.of("load", "s", 49, 2, 3, dst_pages=range(1, 14)), "49 tokens outside 1..48"),
    ],
)
def test_a_move_out_of_range_is_refused_before_anything_changes(mover, model, bad, reason):
    mover.apply([hibernate(to_slot=1, to=(10, 11, 12))], [])  # something to spill
    mover.apply([spill(pages=(10, 11, 12), slot=1, disk=1)], [])
    before = snapshot(mover)
    with pytest.raises(TierMoveRefused, match=reason):
        mover.validate([hibernate(to_slot=2), bad], [1])
    runner = ModelRunner(model, mover.device, mover)
    with pytest.raises(BatchRefused, match=reason):
        runner.execute([], DeferredOps(), moves=[hibernate(to_slot=2), bad], discards=[1])
    assert all(torch.equal(a, b) for a, b in zip(snapshot(mover), before, strict=True))
    assert mover.blobs.path(1).exists()


@pytest.mark.parametrize(
    ("step", "discards", "reason"),
    [
        ([hibernate(), hibernate(slot=4, sid="o")], [], "host page 1 is written twice"),
        ([hibernate(to=(3, 1, 9)), restore()], [], "host page 3 is written before"),
        ([load(disk=1), spill(disk=1, pages=(10, 11, 12), slot=1)], [], "disk slot 1 is written"),
        ([load(disk=1)], [1], "disk slot 1 is discarded and loaded"),
    ],
)
def test_moves_of_one_step_that_conflict_are_refused(mover, step, discards, reason):
    with pytest.raises(TierMoveRefused, match=reason):
        mover.validate(step, discards)


def test_a_step_of_moves_alone_runs_through_the_runner_and_the_session_continues(tmp_path, model):
    """A session prefilled on the device, hibernated, its device state overwritten,
    restored into other pages and slot: it decodes exactly as it would have."""
    mover = build(tmp_path / "state")
    device = mover.device
    device.reset()
    runner = ModelRunner(model, device, mover)
    prompt = np.random.default_rng(1).integers(0, CFG.vocab_size, TOKENS + 1).tolist()
    kv = positions([2, 5, 7], TOKENS + 1)
    runner.execute([StepRow.of(prompt[:TOKENS], 0, kv[:TOKENS], 3)], DeferredOps(clears=[3]))
    expected = runner.execute(
        [StepRow.of(prompt[TOKENS:], TOKENS, kv, 3, mamba_out=6)], DeferredOps(), keep_logits=True
    )
    out = runner.execute([], DeferredOps(), moves=[hibernate()])
    assert (out.tokens, out.failed_moves) == ([], [])
    device.reset()
    missing = load(disk=3, to=(5, 6, 7), slot=1)
    out = runner.execute([], DeferredOps(), moves=[missing, restore(pages=(4, 1, 9), slot=2)])
    assert out.failed_moves == [0]
    kv = positions([10, 11, 1], TOKENS + 1)
    got = runner.execute(
        [StepRow.of(prompt[TOKENS:], TOKENS, kv, 5, mamba_out=6)], DeferredOps(), keep_logits=True
    )
    assert torch.equal(got.logits, expected.logits)
    with pytest.raises(BatchRefused):
        runner.execute([], DeferredOps())


def test_the_service_answers_a_step_of_moves_with_its_failed_ones_and_marks_them(
    redis_url, redis_client, tmp_path, monkeypatch
):
    threads = torch.get_num_threads()
    sizes = {"page_size": PAGE, "kv_pages": 16, "mamba_slots": 8, "context_len": 48}
    room = {"host_state_bytes": 1 << 20, "disk_state_bytes": 1 << 20}
    service = ExecutorService(
        Settings(redis_url=redis_url, state_dir=tmp_path / "state", compile=False, **sizes, **room)
    )
    torch.set_num_threads(threads)  # the service leaves a core to the others
    seen = []

    def unreadable(slot: int, sid: str, tokens: int) -> list[torch.Tensor]:
        seen.append(redis_client.hgetall(streams.SINGLE.tier_in_flight))
        raise BlobMissing(f"{slot}.blob")

    monkeypatch.setattr(service.runner.mover.blobs, "read", unreadable)
    moves = [hibernate(slot=1, to_slot=1, to=(1, 2, 3)), load(disk=1, to=(4, 5, 6), slot=2)]
    step = Step.of("s", 1, service.epoch, [], DeferredOps(), moves=moves, discards=[2])
    try:
        result = decode_result(service.run_step(encode(step)))
    finally:
        service.stop()  # its checks must not answer a later stack's
    assert (result.error, result.failed_moves) == (None, [1])
    moving = {b"adopt": b"0", b"hibernate": b"1", b"spill": b"0", b"load": b"1", b"restore": b"0"}
    assert seen == [moving]
    assert not redis_client.exists(streams.SINGLE.tier_in_flight)

"""A session's blob copied from another replica's disk tier (an `adopt` move, when a
session migrates): bit for bit when it is whole and the session's; refused, with nothing
written, otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.messages.envelope import WireError
from shared.messages.tiers import TierMove
from tests.executor.test_tiers import TOKENS, build, hibernate, load, positions, spill


def adopt(src_slot: int = 2, slot: int = 3, sid: str = "s", replica: str = "0") -> TierMove:
    return TierMove.of("adopt", sid, TOKENS, src_slot, slot, src_replica=replica)


def test_an_adopted_blob_loads_as_the_state_the_other_replica_wrote(tmp_path: Path):
    there, here = build(tmp_path / "replica-0"), build(tmp_path / "replica-1", seed=1)
    src = positions([2, 5, 7])
    expected = [there.device.k[:, src].clone(), there.device.conv[:, 3].clone()]
    assert there.apply([hibernate()], []) == [] and there.apply([spill()], []) == []
    assert here.apply([adopt()], []) == []
    assert (tmp_path / "replica-1" / "3.blob").read_bytes() == (
        tmp_path / "replica-0" / "2.blob"
    ).read_bytes()
    assert here.apply([load(disk=3)], []) == []
    host = here.host
    got = [host.kv_tensors[0][:, positions([3, 6, 8])], host.state_tensors[0][:, 4]]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize("case", ["missing", "other session", "corrupt"])
def test_an_adopt_of_a_bad_blob_fails_alone_and_writes_nothing(tmp_path: Path, case: str):
    there, here = build(tmp_path / "replica-0"), build(tmp_path / "replica-1")
    if case != "missing":
        assert there.apply([hibernate()], []) == [] and there.apply([spill()], []) == []
    if case == "corrupt":
        blob = tmp_path / "replica-0" / "2.blob"
        data = bytearray(blob.read_bytes())
        data[-40] ^= 1
        blob.write_bytes(bytes(data))
    move = adopt(sid="t" if case == "other session" else "s")
    assert here.apply([move], []) == [0]
    assert not list((tmp_path / "replica-1").glob("3.*"))


def test_an_adopt_names_its_replica_and_no_pages():
    with pytest.raises(WireError):
        TierMove.of("adopt", "s", TOKENS, 2, 3)  # no source replica
    with pytest.raises(WireError):
        TierMove.of("adopt", "s", TOKENS, 2, 3, src_replica="../etc")
    with pytest.raises(WireError):
        TierMove.of("spill", "s", TOKENS, 2, 3, src_pages=[1, 2, 3], src_replica="0")

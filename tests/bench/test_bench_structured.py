"""The structured-output benchmark's cells compare like with like: a small-vocabulary
twin of its checkpoint, one repeat of batch 1 and 2, every request of every side
decoding exactly the same number of tokens (`measure` checks it), and the figures it
reports present and in range."""

from pathlib import Path

from custody.bench import structured
from custody.up import Stack
from shared.config import Settings


def test_constrained_and_plain_cells_decode_the_same_tokens(redis_url: str, tmp_path: Path):
    checkpoint = structured.build_checkpoint(tmp_path, vocab=4096)
    stack = Stack(Settings.ephemeral(model=checkpoint, compile=False, redis_url=redis_url))
    try:
        stack.start_all().wait_healthy()
        result = structured.measure(stack.settings, repeats=1, batches=(1, 2))
    finally:
        stack.stop()
    for b in (1, 2):
        assert result[f"ratio_constrained_b{b}"] > 0 and result[f"ratio_regex_b{b}"] > 0
        assert 0 < result[f"mask_share_b{b}"] < 1
    assert set(result["tokens_per_s"]) == {
        f"{s}_b{b}" for s in ("plain", "json", "regex") for b in (1, 2)
    }

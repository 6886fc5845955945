"""A checkpoint may list several end-of-sequence ids: every one of them stops a
generation (the first build kept only the first)."""

import numpy as np

from shared.model_config import ModelConfig, builtin_config
from tests.engine.data_model import reference
from tests.engine.driver import VOCAB, Driver


def test_a_listed_eos_token_id_keeps_every_id():
    raw = builtin_config().to_dict() | {"eos_token_id": [5, 9]}
    config = ModelConfig.from_dict(raw)
    assert config.eos_token_ids == {5, 9}
    assert ModelConfig.from_dict(config.to_dict()).eos_token_ids == {5, 9}  # round trip
    assert builtin_config().eos_token_ids == {builtin_config().eos_token_id}


def test_every_listed_eos_id_stops_a_generation():
    prompt = np.random.default_rng(3).integers(1, VOCAB, size=9).tolist()
    free = reference(prompt, 12, VOCAB)
    never = next(t for t in range(VOCAB) if t not in free)
    d = Driver(eos=(never, free[3]))  # the second id of the list is the one produced
    req = d.generate(prompt, max_new=12)
    d.run()
    assert req.output == free[: free.index(free[3]) + 1]
    assert req.finish_reason.type == "stop" and req.finish_reason.matched == free[3]

"""The speculative decoding benchmark's figures, on the built-in random model (no training):
two short prompts, one repeat. Every drafter's greedy outputs equal speculation off's,
the fields the docs name are there, and each ratio is its two figures' quotient."""

import math

from custody.bench import spec


def test_every_drafter_reports_its_figures_and_decodes_as_off():
    prompts = spec.held_out_prompts(count=2)
    result = spec.measure(None, prompts, new_tokens=10, batches=(1, 2), repeats=1)
    assert 0 <= result["target_accuracy"] <= 1
    for b in (1, 2):
        cell = result[f"b{b}"]
        assert set(cell) == {"off", *spec.DRAFTERS}
        off = cell["off"]
        assert off["tokens"] == 20 and off["draft_forwards"] == 0
        if b == 1:  # one at a time, a prefill and 9 decodes each: a forward per token
            assert off["target_forwards"] == off["tokens"]
        for name in spec.DRAFTERS:
            on = cell[name]
            assert on["outputs_identical_to_off"], (b, name)
            assert on["tokens"] == off["tokens"] and on["draft_forwards"] == 0
            assert on["verify_steps"] > 0
            assert math.isclose(
                on["tokens_per_verify_step"], 1 + on["mean_accepted_tokens"], abs_tol=1e-3
            )
            assert math.isclose(
                on["target_forwards_per_token_ratio"],
                on["target_forwards_per_token"] / off["target_forwards_per_token"],
                rel_tol=1e-3,
            )
            assert math.isclose(
                on["wall_ratio"], on["cpu_wall_s"] / off["cpu_wall_s"], rel_tol=1e-2
            )
            assert on["target_forwards_per_token"] <= off["target_forwards_per_token"]


def test_an_mtp_head_s_side_counts_its_forwards(tmp_path):
    """An untrained head (tests/executor/test_mtp_head.py's checkpoint): its drafts cost
    forwards, and greedy outputs stay off's."""
    import dataclasses

    from shared.model_config import builtin_config
    from tests.executor.test_mtp_head import HEAD, checkpoint

    path = checkpoint(tmp_path, dataclasses.replace(builtin_config(), **HEAD))
    prompts = spec.held_out_prompts(count=2)
    result = spec.measure(path, prompts, 8, (1,), 1, drafters=spec.WITH_HEAD)
    head, off = result["b1"]["mtp_head"], result["b1"]["off"]
    assert head["outputs_identical_to_off"] and head["verify_steps"] > 0
    assert head["draft_forwards"] >= 3 * head["verify_steps"]  # the chain of three guesses
    assert off["draft_forwards"] == 0

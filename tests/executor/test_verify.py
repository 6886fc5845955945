"""Verify rows on real tensors: greedy outputs with speculation equal those without, the
scheduler and the executor in one process (a forced drafter spoils its drafts at every
position in turn, so every acceptance pattern runs through the real Mamba and attention
layers); and the rejection rule keeps the target's distribution, by a chi-square test
that a rule biased by five points of acceptance fails, and one biased by five per cent
of the draft's probability, on a peaked distribution (docs/speculative.md)."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

from custody.inprocess import InProcess
from services.executor import verify
from services.executor.sampling import distribution
from services.scheduler.records.request import Request
from services.scheduler.records.sampling import SamplingParams
from shared.config import Settings
from shared.deferred_ops import DeferredOps
from shared.messages.forward import StepRow
from shared.messages.grammar import GrammarSpec
from tests.test_inprocess import SMALL as INPROCESS

SMALL = dataclasses.replace(INPROCESS, mamba_slots=40)  # room for speculative slots
PROMPTS = ["Once upon a time, once upon a time", "The state of the slots."]


class Oracle:
    """Drafts from a run without speculation (the outputs it gave, by prompt), spoilt
    at position k, k cycling over every pattern."""

    by_head = False

    def __init__(self, outputs: dict[bytes, list[int]]) -> None:
        self.outputs, self.calls = outputs, 0

    def propose(self, req: Request, n: int) -> list[int]:
        done = len(req.output)
        truth = self.outputs[req.prompt.tobytes()][done : done + n]
        k = self.calls % (n + 1)
        self.calls += 1
        return [(t + 1) % 256 if i == k else t for i, t in enumerate(truth)]


def generate(
    local: InProcess, prompts: list[str], n: int, stop: tuple[str, ...] = ()
) -> list[Request]:
    reqs = []
    for i, text in enumerate(prompts):
        prompt = np.asarray(local.tokenizer.encode(text, True))
        params = SamplingParams(max_new_tokens=n, stop=stop)
        reqs.append(local.engine.submit(Request(f"r{i}", prompt, params)))
    local.run_until_idle()
    assert local.engine.check(idle=True).ok
    return reqs


def test_greedy_outputs_with_speculation_equal_those_without():
    off = generate(InProcess(SMALL), PROMPTS, 20)
    forced = InProcess(dataclasses.replace(SMALL, speculative_algorithm="NGRAM"))
    forced.engine.drafter = Oracle({r.prompt.tobytes(): r.output for r in off})
    assert [r.output for r in generate(forced, PROMPTS, 20)] == [r.output for r in off]
    accepted = forced.engine.completion.accepted
    assert accepted.steps > 10 and all(accepted.at_position)
    assert accepted.accepted < accepted.drafted  # rejections at every position ran too
    # a stop string inside accepted drafts: the output ends where it would without
    text = forced.tokenizer.decode(off[0].output)
    stop = (text[9:12],)
    want = generate(InProcess(SMALL), PROMPTS[:1], 20, stop)[0].output
    forced.engine.drafter = Oracle({r.prompt.tobytes(): r.output for r in off})
    got = generate(forced, PROMPTS[:1], 20, stop)[0]
    assert got.output == want and len(want) < 20 and got.finish_reason.type == "stop"


def test_a_session_with_speculation_resumes_exactly_its_kept_state():
    def session_outputs(local: InProcess) -> list[list[int]]:
        sid = local.engine.sessions.open("s").sid
        got = []
        for k, text in enumerate(["Hello hello hello.", " Again, hello hello.", " Once more."]):
            session = local.engine.sessions.get(sid)
            tokens = np.asarray(local.tokenizer.encode(text, not session.history.size))
            params = SamplingParams(max_new_tokens=10)
            req = local.engine.submit_turn(session, tokens, f"t{k}", params)
            local.run_until_idle()
            got.append(req.output)
        local.engine.sessions.close(sid)
        local.run_until_idle()
        assert local.engine.check(idle=True).ok
        return got

    spec = InProcess(dataclasses.replace(SMALL, speculative_algorithm="NGRAM"))
    assert session_outputs(spec) == session_outputs(InProcess(SMALL))
    assert spec.engine.completion.accepted.steps > 0


SAMPLES = 20_000
SAMPLING = {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "min_p": 0.05}


def first_token_distribution(peaked: float = 1.0) -> torch.Tensor:
    """The built-in model's next-token distribution after a fixed context, under the
    sampling parameters of the test; `peaked`: its `lm_head` scaled by that much first
    (a model as sure of its next token as a trained one often is)."""
    local = InProcess(SMALL)
    with torch.no_grad():
        local.model.lm_head.weight.mul_(peaked)
    prompt = np.asarray(local.tokenizer.encode("A fixed context for the test", True))
    row = StepRow.of(prompt, 0, np.arange(4, len(prompt) + 4), 1)  # page 0 is the sink
    logits = local.runner.execute([row], DeferredOps(), keep_logits=True).logits[0]
    return distribution(logits, **SAMPLING)


def draws(probs: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """20,000 first tokens without speculation, and 20,000 verified with the most likely
    token as the draft, each from its own seeded generator."""
    off = torch.multinomial(
        probs, SAMPLES, replacement=True, generator=torch.Generator().manual_seed(1)
    )
    draft = torch.full((SAMPLES,), int(torch.argmax(probs)))
    _, on = verify.speculative_sample(
        probs.expand(SAMPLES, -1), draft, torch.Generator().manual_seed(2)
    )
    return off.numpy(), on.numpy()


def p_value(off: np.ndarray, on: np.ndarray) -> float:
    """Chi-square test of homogeneity over the tokens drawn at least 5 times in all."""
    tokens, counts = np.unique(np.concatenate([off, on]), return_counts=True)
    kept = tokens[counts >= 5]
    table = np.array([[np.sum(side == t) for t in kept] for side in (off, on)])
    return float(chi2_contingency(table)[1])


@pytest.mark.parametrize(
    ("peaked", "planted"),
    [
        (1.0, lambda u, p: u < p + 0.05),  # five points more acceptance
        (12.0, lambda u, p: u < p + 0.05),
        (12.0, lambda u, p: u < p * 1.05),  # five per cent more acceptance
    ],
    ids=["flat-plus-5-points", "peaked-plus-5-points", "peaked-plus-5-percent"],
)
def test_verified_first_tokens_follow_the_target_distribution(monkeypatch, peaked, planted):
    """The built-in model's distribution is flat (the draft, its most likely token, at
    0.076): a bias of five per cent of that is too small for 20,000 draws to see (p =
    0.047 measured), so the relative bias is planted on a peaked one too."""
    probs = first_token_distribution(peaked)
    off, on = draws(probs)
    assert p_value(off, on) >= 1e-3
    monkeypatch.setattr(verify, "accepts", planted)
    off, biased = draws(probs)
    assert p_value(off, biased) < 1e-3


def test_a_constrained_request_beside_speculating_ones_decodes_as_without():
    """A grammar row is never verified (docs/speculative.md): in a speculating engine
    it gives its output without speculation, its neighbours theirs."""
    regex = GrammarSpec(kind="regex", source=r"[a-z]{3}-\d{2}")

    def run(local: InProcess) -> list[list[int]]:
        reqs = [
            Request("c", np.array([72, 105]), SamplingParams(max_new_tokens=20, grammar=regex)),
            Request("p", np.array([72, 105, 72, 105]), SamplingParams(max_new_tokens=20)),
        ]
        for r in reqs:
            local.engine.submit(r)
        local.run_until_idle()
        assert re.fullmatch(regex.source, bytes(t for t in reqs[0].output if t < 256).decode())
        return [r.output for r in reqs]

    spec = InProcess(Settings.ephemeral(compile=False, speculative_algorithm="NGRAM"))
    assert run(spec) == run(InProcess(Settings.ephemeral(compile=False)))
    assert spec.engine.completion.accepted.steps > 0

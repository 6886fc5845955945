"""The history checker of the fault campaign: what the clients saw, judged against what
a session promises whatever fails underneath.

Every turn a client made is a `Turn`. For each session, its acknowledged turns (200) in
the order the client made them form its history: the client's own record of what the
server told it. The invariants:
- no stale turn: each acknowledged turn ran on exactly that history plus its own input
  (the prompt length it reports), and no session the client still holds answers 404
  (a lost session loses the acknowledged history too);
- no twin copy: no replica other than the session's placement answered a probe turn
  (`probe`, sent straight to each other replica after each fault);
- no wrong output: each token of each acknowledged output is the fault-free model's
  greedy choice after its history plus input and the tokens before it, teacher-forced
  (`wrong_outputs`, given the judge: custody/soak/verdict.py `disowned`). A near-tie
  within 1e-3 counts as greedy: batching moves logits by about 1e-6, and comparing
  with a separately batched one-shot counted such a flip as wrong.

What it cannot see: a turn's outcome when the client got no answer (that session is
abandoned, nothing is claimed about it); a wrong token that is a near-tie with the greedy
one; a twin copy that no probe reached (only sessions the load holds are probed, and
only between faults); state the load never asked for."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass
class Turn:
    sid: str
    input_ids: list[int]
    status: int  # 0: no answer (connection lost, timeout)
    started: float
    ended: float
    output_ids: list[int] = field(default_factory=list)
    prompt_tokens: int | None = None
    kind: str = "turn"  # "turn", or "probe" (straight to a replica the session is not on)
    replica: str | None = None  # a probe's replica


@dataclass
class Verdict:
    stale: list[Turn] = field(default_factory=list)  # turns that broke the history
    twins: list[Turn] = field(default_factory=list)  # probes a second copy answered
    examples: list[str] = field(default_factory=list)

    def note(self, what: str) -> None:
        if len(self.examples) < 10:
            self.examples.append(what)


def judge(turns: Sequence[Turn]) -> Verdict:
    """Stale turns and twin copies among `turns` (in the order they were made)."""
    verdict = Verdict()
    history: dict[str, int] = {}  # acknowledged tokens so far, by session
    for t in turns:
        if t.kind == "probe":
            if t.status == 200:
                verdict.twins.append(t)
                verdict.note(f"{t.sid}: replica {t.replica} answered beside its placement")
            continue
        known = history.setdefault(t.sid, 0)
        if t.status == 404 and known:
            verdict.stale.append(t)
            verdict.note(f"{t.sid}: lost after {known} acknowledged tokens")
        if t.status != 200:
            continue
        if t.prompt_tokens != known + len(t.input_ids):
            verdict.stale.append(t)
            verdict.note(f"{t.sid}: ran on {t.prompt_tokens} tokens, not {known}+input")
        history[t.sid] = known + len(t.input_ids) + len(t.output_ids)
    return verdict


def prompts(turns: Sequence[Turn]) -> list[tuple[list[int], list[int]]]:
    """(history plus input, output) of every acknowledged turn."""
    history: dict[str, list[int]] = {}
    out = []
    for t in turns:
        if t.kind != "turn" or t.status != 200:
            continue
        past = history.setdefault(t.sid, [])
        out.append((past + t.input_ids, t.output_ids))
        past += t.input_ids + t.output_ids
    return out


def wrong_outputs(
    turns: Sequence[Turn],
    disowned: Callable[[list[tuple[list[int], list[int]]]], list[bool]],
) -> list[Turn]:
    """Acknowledged turns whose output a fault-free model disowns over their
    acknowledged history plus input (`disowned` judges a batch of (prompt, output))."""
    acked = [t for t in turns if t.kind == "turn" and t.status == 200]
    verdicts = disowned(prompts(turns))
    return [t for t, wrong in zip(acked, verdicts, strict=True) if wrong]

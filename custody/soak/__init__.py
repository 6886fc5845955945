"""`custody soak --duration S [--chaos] [--json]`: concurrent clients against the real
services on pools small enough that evictions, dropped session state and retracts are
routine, then proof that nothing was lost.

The stack runs with two tenant keys and an operator key. The load: six greedy workers
under tenant A (sessions with random turn lengths, disconnects mid-stream, over-long
inputs, closes, idle timeouts, plain requests sharing a prefix), and one hostile client
under both keys (tiny temperatures, seed overflow, huge token ids, lone surrogates, bad
streamed input, NaN and Infinity in JSON, unknown fields, and tenant B trying to abort
tenant A's running request, by id and with abort_all). With `--chaos` the executor, the
scheduler and the session store are SIGKILLed and Redis restarted at random moments.

With `--chaos` the session state tiers are small too: each greedy worker keeps three
sessions open, which outnumber the device pools, so idle sessions hibernate to a host
tier about half the device's size, which fills and spills to a disk tier of 16 blobs;
every tier move sleeps 50 ms half-way (`tier_move_delay_seconds`). Executor kills are
aimed at tier moves: first a drill (drill.py) that, for each of hibernate, spill, load and
restore, places a session where that move starts (`/place_session`, operator key), asks
for the move and kills the executor once the executor's in-flight mark
(`TIER_IN_FLIGHT`) shows it; then, for most of the random executor kills, the monkey
waits for any move in the mark. Each executor kill is counted by the mark the dead
executor left behind (`kills_during_tier_moves`, per kind), and the executor's own
counter of completed moves is summed over its lives (`tier_moves_completed`).

The end: every session is closed and the cache flushed (with the operator key), and then
every slot of every pool must be free in the session store's independent ledger, whatever
its owner kind (request, session, cache, track, transit), in the device pools and, with
tiers, in host_kv, host_mamba and disk, all of which the ledger must hold; no blob may be
left in the state directory; the ledger must have seen no violation; every greedy output
must be the fault-free model's choice, teacher-forced over its exact prompt (a turn's
prompt is the session's whole history, so a turn that resumed from device, host or disk
state, or re-prefilled after its state was lost with an executor, is checked the same
way); every reply must carry the status its input calls for (no 5xx ever); every service
restart must follow a kill the monkey made; and with `--chaos`, at least one kill must
have hit a hibernate, a spill and a restore in flight. Any failure exits non-zero.

What it catches: a slot never given back by any path the clients take (requests,
sessions, cache nodes, track snapshots, tier moves and their transit owners, on every
tier), a transfer by a non-owner or a double free, a blob file its session outlived, a
greedy token that differs from the fault-free model's (a state restored or loaded wrong,
a blob whose half-written copy was used), a 5xx or a wrong status, a hostile input that
crashes or wedges a service, a tenant that can abort another's request.

What it cannot catch: a leak that closing the sessions or flushing the cache frees (a
session or cache node that keeps more than it should until then); a wrong output of a
sampled request (the hostile ones are judged by status and liveness only, and under chaos
an abort is excused); an aborted request's missing tail; a fault in a path no client takes
(the OpenAI routes, logprobs, stop strings, page sizes other than 16, a real checkpoint,
GPU kernels and the copy stream); a wrong status for an input the hostile list does not
contain; a slot moved without an ownership event (the ledger sees only what the stream
announces); a crash that the monkey's own kill happened to cover; slowness, as long as the
calls end within their timeouts. Of tiers in particular: a state dropped where it could
have been kept (a re-prefill gives the same tokens; only `cached_tokens` would tell, and
the soak does not judge it), which tier a turn resumed from (the replay checks every turn
alike), a kill between two tier moves' steps rather than inside one (the mark covers only
a step's moves while they run), a corrupt blob that passes its checksum, a write the
disk refuses (its filesystem never runs out of room here), and a kill during a move on a
GPU, where the copies run on their own stream.
"""

from __future__ import annotations

import json

from custody.soak.campaign import Campaign
from custody.soak.runner import Soak

__all__ = ["Campaign", "Soak", "run", "run_campaign"]


def run(duration: float, chaos: bool, as_json: bool) -> int:
    result = Soak(duration, chaos).run()
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 1 if result["failed"] else 0


def run_campaign(duration: float, replicas: int, dead_seconds: float, as_json: bool) -> int:
    """The distributed fault campaign (campaign.py): one line per fault, then the
    summary; non-zero if an invariant broke or a kind of fault was never injected."""
    campaign = Campaign(duration, replicas, dead_seconds)
    result = campaign.run()
    for row in campaign.rows:
        held = " ".join(
            f"{key}={'ok' if row[key] == 0 else row[key]}"
            for key in ("stale_turns", "twin_copies", "wrong_outputs")
        )
        print(f"{row['at']:7.1f}s  {row['kind']:26} {row['seconds']:5.1f}s  {held}  {row['hit']}")
    print(f"{campaign.turns_acked} turns acknowledged; found: {campaign.examples or 'nothing'}")
    print(f"{campaign.orphans} sessions whose open's answer was lost, closed at the end")
    print(f"stuck: {campaign.load.stuck or 'none'}; lost: {len(campaign.load.lost)}")
    if campaign.deaths_outside_faults():
        print(f"replicas declared dead outside a fault: {campaign.deaths_outside_faults()}")
    if campaign.left_behind:
        print(f"left behind: {campaign.left_behind}")
    if as_json:
        print(json.dumps(result, indent=2))
    return 0 if campaign_held(result) else 1


def campaign_held(result: dict) -> bool:
    """Every invariant held and every kind of fault was injected."""
    return (
        all(result["faults"].values())
        and result["stale_turns"] == result["twin_copies"] == result["wrong_outputs"] == 0
        and not any(result["leaked_slots"].values())
        and result["leaked_placements"] == result["stuck_sessions"] == 0
        and result["deaths_outside_faults"] == 0
    )

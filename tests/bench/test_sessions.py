"""The sessions workload's pure parts: sessions are seeded and each turn extends the
last prompt and its reply; play sends a session's turns in order, each after the one
before ended and its think time (in virtual time), and stops at a failed turn; the
report's by-turn figures, on hand-made records."""
from __future__ import annotations

import asyncio
import statistics

import pytest

from pdserve.bench import report
from pdserve.bench.metrics import SLO, RequestRecord, by_turn, session_counts, summarize
from pdserve.bench.sessions import MAX_TURNS, SessionShape, play
from pdserve.bench.workloads import make_workload
from pdserve.sim import virtual_time


def sessions(seed: int = 3, num: int = 40, **shape):
    return make_workload("sessions", num, vocab_size=1000, seed=seed, scale=0.05,
                         sessions=SessionShape(**shape))


def reply_to(turn) -> list[int]:
    """A server's reply, a function of the prompt."""
    return [4 + (len(turn.prompt) + i) % 90 for i in range(turn.max_tokens)]


def turns_of(session, reply=reply_to) -> list[tuple]:
    """(think time before it, turn) of each of the session's turns, replies as `reply`."""
    turn = session.first_turn()
    turns = [(0.0, turn)]
    while (following := session.next_turn(reply(turn))) is not None:
        turn = following[1]
        turns.append(following)
    return turns


def test_sessions_are_seeded_and_each_turn_extends_the_last_prompt_and_its_reply():
    played = [turns_of(s) for s in sessions()]
    assert played == [turns_of(s) for s in sessions()]
    assert played != [turns_of(s) for s in sessions(seed=4)]
    # a session's turns do not depend on when the others are drawn or played
    assert [turns_of(s) for s in reversed(sessions())] == played[::-1]
    context = SessionShape().context(0.05)
    for number, session in enumerate(played):
        for k, (think_s, turn) in enumerate(session):
            assert (turn.session, turn.turn) == (number, k + 1)
            assert len(turn.prompt) + turn.max_tokens <= context
            assert think_s >= 0
            if k:
                last = session[k - 1][1]
                history = last.prompt + reply_to(last)
                assert turn.prompt[:len(history)] == history
                assert len(turn.prompt) > len(history)
    assert max(len(s) for s in played) > 3


def test_a_reply_the_server_did_not_return_is_random_tokens_of_the_length_asked():
    session = sessions(num=1, mean_turns=8)[0]
    first = session.first_turn()
    _, second = session.next_turn([])
    filler = second.prompt[len(first.prompt):len(first.prompt) + first.max_tokens]
    assert second.prompt[:len(first.prompt)] == first.prompt
    assert len(filler) == first.max_tokens and filler != reply_to(first)


def test_turns_are_one_plus_geometric_with_the_asked_mean_and_fit_the_context():
    drawn = sessions(num=2000, mean_turns=5)
    assert statistics.fmean(s.num_turns for s in drawn) == pytest.approx(5, rel=0.1)
    assert min(s.num_turns for s in drawn) == 1 and max(s.num_turns for s in drawn) <= MAX_TURNS
    small = sessions(num=30, mean_turns=20, max_model_len=300)
    for session in small:
        played = turns_of(session)
        assert all(len(t.prompt) + t.max_tokens <= 300 for _, t in played)
        assert len(played) <= session.num_turns
    with pytest.raises(ValueError, match="mean turns"):
        SessionShape(mean_turns=0.5)


def test_play_sends_each_turn_after_the_last_ended_and_its_think_time_and_stops_at_a_failure():
    twins = sessions(num=6, think_s=4.0)
    expected = [turns_of(s) for s in sessions(num=6, think_s=4.0)]
    failing = next(n for n, turns in enumerate(expected) if len(turns) >= 3)
    sent: dict[int, list[tuple[float, float, int]]] = {}

    async def scenario():
        loop = asyncio.get_running_loop()

        async def send(turn, reply):
            record = RequestRecord(loop.time(), session=turn.session, turn=turn.turn)
            await asyncio.sleep(0.5 + turn.session * 0.1)  # the server's time, on the virtual clock
            record.end_time = loop.time()
            if (turn.session, turn.turn) == (failing, 2):
                record.error = "boom"
            else:
                reply += reply_to(turn)
            sent.setdefault(turn.session, []).append((record.send_time, record.end_time,
                                                      turn.turn))
            return record
        await asyncio.gather(*[play(s, send) for s in twins])
    virtual_time.run(scenario())
    for number, turns in sent.items():
        assert [k for _, _, k in turns] == list(range(1, len(turns) + 1))
        for (_, end, _), (start, _, k) in zip(turns, turns[1:]):
            assert start == pytest.approx(end + expected[number][k - 1][0])
    assert len(sent[failing]) == 2 < len(expected[failing])  # its turn 2 failed: it ended
    assert all(len(sent[n]) == len(expected[n]) for n in range(6) if n != failing)


def rec(session, turn, ttft, prompt=100, cached=0, host=0, ok=True, rejected=False):
    r = RequestRecord(0.0, prompt, [ttft, ttft + 0.01], None if not ok else ttft + 0.01,
                      error=None if ok or rejected else "boom", rejected=rejected,
                      num_cached_tokens=cached, num_host_cached_tokens=host,
                      session=session, turn=turn)
    if rejected:
        r.end_time = 0.0
    return r


def test_by_turn_buckets_turns_four_on_together_and_splits_hits_by_tier():
    records = [rec(0, 1, 0.10), rec(0, 2, 0.02, cached=80), rec(0, 3, 0.03, cached=90),
               rec(0, 4, 0.04, cached=60, host=30), rec(0, 5, 0.06, cached=100),
               rec(1, 1, 0.30), rec(1, 2, 0.04, cached=40, host=40),
               rec(1, 3, 0.05, ok=False),  # failed: session 1 ended there
               rec(2, 1, 0.20, rejected=True)]  # refused: session 2 ended at once
    turns = by_turn(records)
    assert list(turns) == ["1", "2", "3", "4+"]
    assert [t["requests"] for t in turns.values()] == [3, 2, 2, 2]
    assert [t["completed"] for t in turns.values()] == [2, 2, 1, 2]
    assert turns["1"]["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert turns["1"]["ttft_ms"]["p90"] == pytest.approx(100 + 0.9 * 200)
    assert turns["4+"]["ttft_ms"]["p50"] == pytest.approx(50.0)
    assert turns["1"]["prefix_hit_share"] == {"device": 0.0, "host": 0.0}
    assert turns["2"]["cached_tokens"] == {"device": 80, "host": 40}
    assert turns["2"]["prefix_hit_share"] == pytest.approx({"device": 0.4, "host": 0.2})
    assert turns["3"]["cached_tokens"] == {"device": 90, "host": 0}  # of completed only
    assert turns["4+"]["prefix_hit_share"] == pytest.approx({"device": 0.65, "host": 0.15})
    assert session_counts(records) == {"sessions": 3, "turns": 9, "ended_by_failure": 2}

    s = summarize(records, 10.0, SLO(ttft_ms=150))
    assert s["by_turn"] == turns and s["sessions"]["ended_by_failure"] == 2
    assert s["completed"] == 7 and s["slo_attainment"] == pytest.approx(6 / 9)
    text = report.text_block(s)
    assert "Sessions ended by a failed turn:         2" in text
    assert "4+           2      50.0      58.0   0.650  0.150" in text
    plain = summarize([rec(None, None, 0.1)], 1.0, SLO())
    assert "by_turn" not in plain and "sessions" not in plain
    assert "Sessions" not in report.text_block(plain)

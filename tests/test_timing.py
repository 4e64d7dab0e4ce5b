"""torchq.timing: interleaved rounds, the spread, and the note when configs cannot be ranked."""

import pytest

from torchq.timing import Timing, noise_note, overlapping_pairs, time_interleaved


def test_rounds_are_interleaved_and_counted():
    calls: list[str] = []
    rounds_seen: list[int] = []
    out = time_interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3, warmup=1,
                           on_round=rounds_seen.append)
    assert calls == ["a", "b"] + ["a", "b"] * 3 and rounds_seen == [1, 2, 3]
    assert {len(t.samples) for t in out.values()} == {3}


def test_spread_and_noise_note():
    fast, slow = Timing((1.0, 1.01, 0.99, 1.0)), Timing((2.0, 2.02, 1.98, 2.0))
    assert fast.spread < 0.05 and not fast.noisy
    assert noise_note({"fast": fast, "slow": slow}) is None
    wide = Timing((1.0, 2.5, 0.9, 2.4, 1.1))
    assert wide.noisy and wide.overlaps(slow)
    assert overlapping_pairs({"fast": fast, "wide": wide, "slow": slow}) == [("fast", "wide"), ("wide", "slow")]
    note = noise_note({"fast": fast, "wide": wide}, "smollm")
    assert note.startswith("note: smollm: the machine is too noisy") and "wide" in note.splitlines()[0]
    assert "ranges overlap for fast/wide" in note.splitlines()[1]
    with pytest.raises(ValueError, match="samples"):
        Timing(())
    with pytest.raises(ValueError, match="rounds"):
        time_interleaved({}, rounds=0)

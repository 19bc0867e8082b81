"""The journal's room: new handoffs refused below the reserve, with the
pages SQLite freed inside the journal counted once the volume runs short."""

from __future__ import annotations

from pathlib import Path

import pytest

from handoff_server.durability.journal import Journal
from handoff_server.durability.space import MIB, Headroom, VolumeLow

REFUSAL = (
    "new handoffs are refused so the ones in flight can still be journaled to their end; "
    "free space on that volume or grow it (handoffs that end and leave retention free room "
    "in the journal too)"
)


class Volume:
    """A volume's free bytes as the test sets them, and what the journal was told."""

    def __init__(self, free: int, reusable: int = 0) -> None:
        self.free, self.reusable = free, reusable
        self.measuring: list[bool] = []

    def headroom(self, reserve_mib: int = 64) -> Headroom:
        return Headroom(
            Path("/var/lib/handoff"),
            reserve_mib,
            lambda: self.reusable,
            self.measuring.append,
            free=lambda path: self.free,
        )


def test_a_start_is_admitted_while_the_volume_has_its_reserve() -> None:
    volume = Volume(free=64 * MIB)
    volume.headroom().check_start()
    assert volume.measuring == [False]  # the journal is not asked to measure its pages


def test_a_start_is_refused_below_the_reserve_naming_the_setting_and_the_fix() -> None:
    volume = Volume(free=10 * MIB, reusable=2 * MIB)
    with pytest.raises(VolumeLow) as refused:
        volume.headroom().check_start()
    assert refused.value.code == "RESOURCE_EXHAUSTED"
    assert str(refused.value) == (
        "the journal's volume (--state-dir /var/lib/handoff) has 12.0 MiB left for the "
        f"journal, less than the 64 MiB reserve (journal_reserve_mib): {REFUSAL}"
    )
    assert volume.measuring == [True]


def test_pages_freed_inside_the_journal_count_as_room() -> None:
    """Handoffs that ended and left retention freed pages SQLite writes into
    before it grows the file: with those, the reserve is there again."""
    volume = Volume(free=40 * MIB, reusable=30 * MIB)
    volume.headroom().check_start()
    assert volume.measuring == [True]


def test_a_reserve_of_zero_never_refuses() -> None:
    Volume(free=0).headroom(reserve_mib=0).check_start()


def test_the_journal_measures_its_free_pages_only_when_asked(tmp_path: Path) -> None:
    journal = Journal.open(tmp_path)
    try:
        for number in range(200):
            journal.append(f"h{number}", 1.0, ["note", "x" * 2000])
        journal.commit_now()
        for number in range(200):
            journal.drop(f"h{number}")
        journal.commit_now()
        assert journal.reusable_bytes() == 0  # measured at open only
        journal.measure_reusable(True)
        journal.append("h-last", 1.0, ["note"])
        journal.commit_now()
        assert journal.reusable_bytes() > 200 * 2000 // 2
    finally:
        journal.close_now()

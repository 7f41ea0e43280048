"""service/billing/journal_file.py: offsets, checkpoints and the compaction crash window."""

import msgspec
import pytest

from service.billing.journal_file import JournalEntry, JournalFile, encode
from service.billing.usage import UsageRecord


def line(i: int) -> bytes:
    record = UsageRecord(f"req-{i}", "acme", "stories", 10, 0, 1, "stop", 1.0, 2.0)
    return encode(JournalEntry(record, i)) + b"\n"


def test_read_batch_returns_entries_in_order_and_the_offset_past_them(tmp_path):
    file = JournalFile(tmp_path / "usage.jsonl")
    assert file.open() == 0
    file.write(b"".join(line(i) for i in range(5)))
    entries, num_lines, end = file.read_batch(max_records=3)
    assert [e.cost_pico_usd for e in entries] == [0, 1, 2]
    assert (num_lines, end) == (3, file.header_end + len(line(0) + line(1) + line(2)))
    file.mark_applied(end)
    entries, num_lines, end = file.read_batch(max_records=3)
    assert ([e.cost_pico_usd for e in entries], end) == ([3, 4], file.durable_end)
    file.close()


def test_reopening_replays_only_what_follows_the_checkpoint(tmp_path):
    file = JournalFile(tmp_path / "usage.jsonl")
    file.open()
    file.write(b"".join(line(i) for i in range(5)))
    file.mark_applied(file.read_batch(max_records=2)[2])
    file.close()
    again = JournalFile(tmp_path / "usage.jsonl")
    assert again.open() == 3
    assert [e.cost_pico_usd for e in again.read_batch(10)[0]] == [2, 3, 4]
    again.close()


def test_a_crash_between_compaction_and_its_checkpoint_replays_just_the_tail(tmp_path):
    file = JournalFile(tmp_path / "usage.jsonl")
    file.open()
    file.write(b"".join(line(i) for i in range(5)))
    file.mark_applied(file.read_batch(max_records=3)[2])
    old_checkpoint = file.checkpoint_path.read_bytes()
    file.compact()
    assert file.path.read_bytes().count(b"\n") == 3  # header + the 2 unapplied lines
    file.checkpoint_path.write_bytes(old_checkpoint)  # the new checkpoint never made it to disk
    file.close()
    again = JournalFile(tmp_path / "usage.jsonl")
    assert again.open() == 2
    assert [e.cost_pico_usd for e in again.read_batch(10)[0]] == [3, 4]
    assert msgspec.json.decode(old_checkpoint)["file_id"] != again.file_id
    again.close()


def test_a_file_that_is_not_a_journal_is_refused(tmp_path):
    (tmp_path / "usage.jsonl").write_text("hello\n")
    with pytest.raises(RuntimeError, match="is not a usage journal"):
        JournalFile(tmp_path / "usage.jsonl").open()
    (tmp_path / "usage.jsonl").write_bytes(b"")
    file = JournalFile(tmp_path / "usage.jsonl")
    assert file.open() == 0  # the refused open released its lock
    file.close()

"""The usage journal's bytes on disk: JSON lines, a checkpoint side file, compaction.

    <path>              {"journal": "pagedserve-usage", "version": 1, "file_id": "9f0c..."}   header
                        {"record": {...UsageRecord...}, "cost_pico_usd": 2128400000}      one per record
                        ...
    <path>.checkpoint   {"file_id": "9f0c...", "offset": 18342}    written to .tmp, fsynced, renamed
    <path>.lock         flock: one journal per file

    offset:   0        header_end            applied_end                durable_end
              | header | in the ledger        | on disk, not yet applied  |

A checkpoint whose file_id differs from the header's (or is missing or unreadable) means
"replay from header_end": replays are deduplicated by the ledger, so a stale checkpoint costs
time, never money. Compaction writes a fresh header (new file_id) + the unapplied tail to
<path>.compact and renames it over <path> before writing the new checkpoint; a crash between
the two leaves an old file_id in the checkpoint, so the new file is replayed whole: exactly its
unapplied tail.

Every method blocks (disk I/O): UsageJournal calls them from worker threads, never two that
change offsets at once.
"""

from __future__ import annotations

import fcntl
import os
import secrets
from pathlib import Path

import msgspec
import structlog

from service.billing.usage import UsageRecord

log = structlog.get_logger(__name__)

JOURNAL_NAME = "pagedserve-usage"
JOURNAL_VERSION = 1
READ_CHUNK = 1 << 20


class JournalEntry(msgspec.Struct, frozen=True):
    """One line of the journal."""

    record: UsageRecord
    cost_pico_usd: int


class _Header(msgspec.Struct, frozen=True):
    journal: str
    version: int
    file_id: str


class _Checkpoint(msgspec.Struct, frozen=True):
    file_id: str
    offset: int


encode = msgspec.json.Encoder().encode
_decode_entry = msgspec.json.Decoder(JournalEntry).decode


def _fsync_dir(path: Path) -> None:
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_new(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _header_line(file_id: str) -> bytes:
    return encode(_Header(JOURNAL_NAME, JOURNAL_VERSION, file_id)) + b"\n"


class JournalFile:
    """Append, read back in order, checkpoint and compact one journal file (see the module doc)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.checkpoint_path = self.path.with_name(self.path.name + ".checkpoint")
        self.file_id = ""
        self.header_end = 0
        self.applied_end = 0
        self.durable_end = 0
        self._fd: int | None = None
        self._lock_fd: int | None = None

    def open(self) -> int:
        """Lock, create or validate, cut a torn last line, read the checkpoint; returns lines to replay."""
        self._lock_fd = os.open(self.path.with_name(self.path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.close()
            raise RuntimeError(f"the usage journal {self.path} is in use by another journal") from None
        try:
            return self._open_locked()
        except BaseException:
            self.close()
            raise

    def _open_locked(self) -> int:
        if not self.path.exists() or self.path.stat().st_size == 0:
            _write_new(self.path, _header_line(secrets.token_hex(8)))
            _fsync_dir(self.path)
        with open(self.path, "rb") as f:
            header_line = f.readline()
        try:
            header = msgspec.json.decode(header_line, type=_Header)
        except msgspec.DecodeError:
            header = None
        if header is None or header.journal != JOURNAL_NAME or header.version != JOURNAL_VERSION:
            raise RuntimeError(f"{self.path} is not a usage journal (version {JOURNAL_VERSION})")
        self.file_id, self.header_end = header.file_id, len(header_line)
        size = self.path.stat().st_size
        self.applied_end = self.header_end
        checkpoint = self._read_checkpoint()
        if checkpoint is not None and checkpoint.file_id == self.file_id \
                and self.header_end <= checkpoint.offset <= size:
            self.applied_end = checkpoint.offset
        num_lines, end = self._scan_lines(self.applied_end)
        if end < size:
            log.warning("usage journal ends in a torn line; cutting it", path=str(self.path), num_bytes=size - end)
            os.truncate(self.path, end)
        self.durable_end = end
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        return num_lines

    def _read_checkpoint(self) -> _Checkpoint | None:
        try:
            return msgspec.json.decode(self.checkpoint_path.read_bytes(), type=_Checkpoint)
        except (FileNotFoundError, msgspec.DecodeError):
            return None

    def _scan_lines(self, start: int) -> tuple[int, int]:
        """(complete lines from `start` on, the offset just past the last of them)."""
        num_lines, end, pos = 0, start, start
        with open(self.path, "rb") as f:
            f.seek(start)
            while chunk := f.read(READ_CHUNK):
                num_lines += chunk.count(b"\n")
                last = chunk.rfind(b"\n")
                if last >= 0:
                    end = pos + last + 1
                pos += len(chunk)
        return num_lines, end

    def write(self, data: bytes) -> None:
        """Append whole lines and fdatasync; on an error, cut back what was half written and raise."""
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
            os.fdatasync(self._fd)
        except OSError:
            os.ftruncate(self._fd, self.durable_end)
            raise
        self.durable_end += len(data)

    def read_batch(self, max_records: int) -> tuple[list[JournalEntry], int, int]:
        """Up to `max_records` entries after applied_end: (entries, lines consumed, offset past them)."""
        start = self.applied_end
        with open(self.path, "rb") as f:
            f.seek(start)
            data = f.read(min(self.durable_end - start, READ_CHUNK))
            lines = data.split(b"\n")[:-1][:max_records]  # what is durable ends with b"\n"
            if not lines:  # one line longer than a chunk
                f.seek(start)
                lines = [f.readline().rstrip(b"\n")]
        entries = []
        for line in lines:
            try:
                entries.append(_decode_entry(line))
            except msgspec.DecodeError as error:  # append never writes one; it stays in the file and the log
                log.error("skipping an unreadable usage journal line", path=str(self.path), error=str(error),
                          line=line.decode(errors="replace"))
        return entries, len(lines), start + sum(len(line) + 1 for line in lines)

    def mark_applied(self, end: int) -> None:
        """Everything before `end` is in the ledger: move applied_end and write the checkpoint."""
        self.applied_end = end
        self._write_checkpoint()

    def _write_checkpoint(self) -> None:
        tmp = self.checkpoint_path.with_name(self.checkpoint_path.name + ".tmp")
        _write_new(tmp, encode(_Checkpoint(self.file_id, self.applied_end)))
        os.replace(tmp, self.checkpoint_path)

    def compact(self) -> None:
        """Replace the file by a fresh header + the unapplied tail (no write may run meanwhile)."""
        with open(self.path, "rb") as f:
            f.seek(self.applied_end)
            tail = f.read(self.durable_end - self.applied_end)
        file_id = secrets.token_hex(8)
        header_line = _header_line(file_id)
        tmp = self.path.with_name(self.path.name + ".compact")
        _write_new(tmp, header_line + tail)
        os.replace(tmp, self.path)
        _fsync_dir(self.path)
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self.file_id = file_id
        self.header_end = self.applied_end = len(header_line)
        self.durable_end = self.header_end + len(tail)
        self._write_checkpoint()

    def close(self) -> None:
        """Close the file and release the lock."""
        for fd in (self._fd, self._lock_fd):
            if fd is not None:
                os.close(fd)
        self._fd = self._lock_fd = None

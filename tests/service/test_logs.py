"""Log lines leave the process whole: one write per line, so no other writer can split one."""

from __future__ import annotations

import io
import json
import sys

import structlog

from service.logs import configure_logging


class _Writes(io.StringIO):
    """A stream that keeps each write() call apart."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return len(text)


def test_each_json_line_is_one_write_with_its_newline(monkeypatch):
    stream = _Writes()
    monkeypatch.setattr(sys, "stderr", stream)
    try:
        configure_logging("info", json=True)
        log = structlog.get_logger("test")
        log.info("worker lost", worker_id=7, after_first_frame=False)
        log.warning("second", n=2)
    finally:
        structlog.reset_defaults()
    # a line split over two writes (print's text, then its newline) lets another writer's bytes in between
    assert len(stream.calls) == 2, stream.calls
    for call in stream.calls:
        assert call.endswith("\n") and call.count("\n") == 1
        json.loads(call)
    assert json.loads(stream.calls[0])["worker_id"] == 7

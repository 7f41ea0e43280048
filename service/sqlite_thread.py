"""One SQLite connection owned by one worker thread, awaited from the event loop.

The ledger, the pin registry and the response store each keep one: SQLite objects belong to
the thread that made them, and a statement must never block the loop.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


class SQLiteThread:
    """A WAL-mode connection to `path` with `schema` applied, used only from its own thread."""

    def __init__(self, path: str | Path, schema: str, *, synchronous: str = "FULL", name: str = "sqlite",
                 migrate: Callable[[sqlite3.Connection], None] | None = None) -> None:
        if synchronous not in ("FULL", "NORMAL"):
            raise ValueError(f"synchronous must be FULL or NORMAL, got {synchronous!r}")
        self.path = Path(path)
        self.name = name
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.conn: sqlite3.Connection | None = self._executor.submit(self._open, schema, synchronous, migrate).result()

    def _open(self, schema: str, synchronous: str, migrate) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=10.0)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={synchronous}")
        conn.executescript(schema)
        if migrate is not None:  # a file written by an older schema, brought up to this one
            migrate(conn)
        return conn

    async def call(self, fn, *args):
        """`fn(*args)` on the connection's thread (fn reads `self.conn`); RuntimeError once closed."""
        if self.conn is None:
            raise RuntimeError(f"the {self.name} database {self.path} is closed")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def close(self) -> None:
        """Close the connection and stop the thread; closing twice is a no-op."""
        if self.conn is None:
            return
        await self.call(self.conn.close)
        self.conn = None
        self._executor.shutdown(wait=True)

"""The service with bench/stub_engine.py's instant engine: `python bench/stub_server.py --port N`."""

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.stub_engine import StubEngine  # noqa: E402
from config import load_settings  # noqa: E402
from service.logs import configure_logging  # noqa: E402
from service.server import run  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--data-dir", default=None, help="ledger and usage journal folder (default: a new temp dir)")
    parser.add_argument("--reply-before-usage-on-disk", action="store_true",
                        help="server.reply_after_usage_on_disk = false (the durability benchmark's baseline)")
    args = parser.parse_args()
    settings = load_settings(environ={}, overrides={"server": {
        "model": "stub", "port": args.port, "max_queued_requests": 4096,
        "data_dir": args.data_dir or tempfile.mkdtemp(prefix="stub-"),
        "reply_after_usage_on_disk": not args.reply_before_usage_on_disk}})
    configure_logging("warning")
    run(settings, engine_factory=lambda s: StubEngine(s.engine.max_num_seqs))

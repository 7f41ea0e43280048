"""`pagedserve generate` streams the model's text to stdout."""

import subprocess
import sys


def test_generate_prints_the_greedy_continuation(stories_dir, golden):
    case = golden["cases"][0]
    result = subprocess.run(
        [sys.executable, "-m", "service.cli", "generate", "--model", str(stories_dir), "--max-tokens", "30", case["prompt"]],
        capture_output=True, text=True, timeout=120, check=True,
    )
    assert result.stdout.strip() == case["text"]
    assert "finish_reason=length" in result.stderr


def test_generate_runs_the_demo_model():
    result = subprocess.run(
        [sys.executable, "-m", "service.cli", "generate", "--model", "demo", "--max-tokens", "5", "Hi"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    assert result.stdout.startswith("Hi") and "5 tokens" in result.stderr

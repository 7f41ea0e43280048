"""A GGUF file's tokenizer, built by transformers' GGUF conversion in a child process.

The conversion (AutoTokenizer with `gguf_file=`) imports ~900 modules on its way (torch.distributed,
sympy, accelerate): ~190 MB that would stay resident in the server for good, for a tokenizer whose
Rust object takes ~30 MB (Llama 3's 128k vocabulary). So a child process runs it and hands back what
the server keeps: the tokenizer as tokenizer.json text, its bos and eos tokens and the chat template.
The server builds the same Rust tokenizer from that text (the same token ids: the JSON is the
tokenizer's whole state). The child starts while the weights load, so it costs no start-up time.

    python -m runtime.gguf_tokenizer FILE.gguf OUT.json    (what TokenizerBuild runs)
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec

REPO = Path(__file__).resolve().parents[1]  # the child imports `runtime` from here
BUILD_TIMEOUT_S = 600.0  # a tokenizer of any size builds in seconds; past this the child is stuck


class TokenizerParts(msgspec.Struct):
    """What the server keeps of a GGUF file's tokenizer (or, from a failed build, why not)."""
    tokenizer_json: str = ""
    bos_token: str | None = None
    eos_token: str | None = None
    chat_template: str | None = None
    error: str | None = None  # "ExceptionType: message" from a build that failed


class TokenizerBuildError(RuntimeError):
    """The child could not build the tokenizer; the message says why (the caller names the file)."""


class TokenizerBuild:
    """The child process building one file's tokenizer: start it, go on, then take `parts()`."""

    def __init__(self, path: str | Path) -> None:
        descriptor, name = tempfile.mkstemp(prefix="pagedserve-tokenizer-", suffix=".json")
        os.close(descriptor)
        self._out = Path(name)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        self._child = subprocess.Popen([sys.executable, "-m", "runtime.gguf_tokenizer", str(path), str(self._out)],
                                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                       env=env)

    def parts(self) -> TokenizerParts:
        """Wait for the child; its TokenizerParts, or TokenizerBuildError naming what went wrong."""
        try:
            _, stderr = self._child.communicate(timeout=BUILD_TIMEOUT_S)
            data = self._out.read_bytes()
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.communicate()
            raise TokenizerBuildError(f"building it took over {BUILD_TIMEOUT_S:.0f} s") from None
        finally:
            self._out.unlink(missing_ok=True)
        parts = msgspec.json.decode(data, type=TokenizerParts) if data else None
        if parts is None or parts.error or self._child.returncode != 0:
            last = stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {self._child.returncode}"]
            raise TokenizerBuildError(parts.error if parts is not None and parts.error else last[0])
        return parts


    def cancel(self) -> None:
        """Stop the child (its tokenizer is no longer wanted) and remove its output."""
        self._child.kill()
        self._child.communicate()
        self._out.unlink(missing_ok=True)


def build_parts(path: Path) -> TokenizerParts:
    """The conversion itself (in the child): transformers' tokenizer for the file, as TokenizerParts."""
    from transformers import AutoTokenizer

    with _one_reader(path):
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return TokenizerParts(hf.backend_tokenizer.to_str(), hf.bos_token, hf.eos_token, hf.chat_template)


@contextlib.contextmanager
def _one_reader(path: Path) -> Iterator[None]:
    """While inside, gguf.GGUFReader(path) gives one reader, parsed once.

    transformers parses the file with gguf's GGUFReader twice (once for the config that picks the
    tokenizer's class, once for the tokenizer): each a full parse of the vocabulary and merges, ~2.3 s
    for SmolLM2's 49,152 tokens. Any other file, or other arguments, get a new reader as before.
    """
    import gguf

    original = gguf.GGUFReader
    shared: list = []

    def reader(name, *args, **kwargs):
        if args or kwargs or Path(name).resolve() != path.resolve():
            return original(name, *args, **kwargs)
        if not shared:
            shared.append(original(name))
        return shared[0]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def main() -> None:
    path, out = Path(sys.argv[1]), Path(sys.argv[2])
    try:
        parts = build_parts(path)
    except Exception as exc:  # any failure of the conversion is reported to the parent, which names the file
        out.write_bytes(msgspec.json.encode(TokenizerParts(error=f"{type(exc).__name__}: {exc}")))
        sys.exit(1)
    out.write_bytes(msgspec.json.encode(parts))


if __name__ == "__main__":
    main()

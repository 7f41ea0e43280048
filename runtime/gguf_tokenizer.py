"""A GGUF file's tokenizer, built by transformers' GGUF conversion in a child process.

The conversion (AutoTokenizer with `gguf_file=`) imports ~900 modules on its way (torch.distributed,
sympy, accelerate): ~190 MB that would stay resident in the server for good, for a tokenizer whose
Rust object takes ~30 MB (Llama 3's 128k vocabulary). So a child process runs it and hands back what
the server keeps: the tokenizer as tokenizer.json text, its bos and eos tokens and the chat template.
The server builds the same Rust tokenizer from that text (the same token ids: the JSON is the
tokenizer's whole state). The child starts while the weights load, so it costs no start-up time.

What the child gives is kept on disk, keyed by a hash of the file's metadata (everything before the
tensor data: the tokenizer is made from it alone) and transformers' version: a server started again
on the same file, or on a copy, skips the child. The cache lives in $PAGEDSERVE_CACHE_DIR, else
$XDG_CACHE_HOME/pagedserve, else ~/.cache/pagedserve (gguf-tokenizers/); an entry that cannot be
read is built again, and one that cannot be written is only logged.

    python -m runtime.gguf_tokenizer FILE.gguf OUT.json    (what TokenizerBuild runs)
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec
import structlog

log = structlog.get_logger(__name__)

REPO = Path(__file__).resolve().parents[1]  # the child imports `runtime` from here
BUILD_TIMEOUT_S = 600.0  # a tokenizer of any size builds in seconds; past this the child is stuck
CACHE_FORMAT = 1  # bump when TokenizerParts or the conversion's use changes
HASH_CHUNK_BYTES = 1 << 22


class TokenizerParts(msgspec.Struct):
    """What the server keeps of a GGUF file's tokenizer (or, from a failed build, why not)."""
    tokenizer_json: str = ""
    bos_token: str | None = None
    eos_token: str | None = None
    chat_template: str | None = None
    error: str | None = None  # "ExceptionType: message" from a build that failed


class TokenizerBuildError(RuntimeError):
    """The child could not build the tokenizer; the message says why (the caller names the file)."""


def cache_dir() -> Path:
    """Where built tokenizers are kept (see the module's docstring)."""
    if os.environ.get("PAGEDSERVE_CACHE_DIR"):
        return Path(os.environ["PAGEDSERVE_CACHE_DIR"]) / "gguf-tokenizers"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagedserve" / "gguf-tokenizers"


def metadata_key(path: Path, metadata_bytes: int) -> str:
    """The cache key of a file's tokenizer: sha256 of its first `metadata_bytes` bytes (the header), the
    cache format and transformers' version (the conversion's code)."""
    try:
        converter = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:  # the child then says what is missing
        converter = "absent"
    digest = hashlib.sha256(f"{CACHE_FORMAT} {converter}\n".encode())
    with path.open("rb") as file:
        left = metadata_bytes
        while left > 0:
            chunk = file.read(min(left, HASH_CHUNK_BYTES))
            if not chunk:
                break
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()


class TokenizerBuild:
    """One file's tokenizer: from the cache, or a child process building it (started here; take `parts()`)."""

    def __init__(self, path: str | Path, metadata_bytes: int) -> None:
        self._child = None
        self._entry = cache_dir() / f"{metadata_key(Path(path), metadata_bytes)}.json"
        self._cached = self._read_entry()
        if self._cached is not None:
            return
        descriptor, name = tempfile.mkstemp(prefix="pagedserve-tokenizer-", suffix=".json")
        os.close(descriptor)
        self._out = Path(name)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        # run from the repository, so that `-m runtime...` finds this package whatever the server's folder holds
        self._child = subprocess.Popen([sys.executable, "-m", "runtime.gguf_tokenizer", str(Path(path).resolve()),
                                        str(self._out)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.PIPE, env=env, cwd=REPO)

    @property
    def from_cache(self) -> bool:
        """Whether the tokenizer came from the cache (no child was started)."""
        return self._cached is not None

    def _read_entry(self) -> TokenizerParts | None:
        """The cache's entry for this file, or None if there is none usable (the child then builds it)."""
        try:
            parts = msgspec.json.decode(self._entry.read_bytes(), type=TokenizerParts)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            return None
        return parts if parts.tokenizer_json and not parts.error else None

    def parts(self) -> TokenizerParts:
        """The cached TokenizerParts, or the child's (then kept in the cache); TokenizerBuildError naming what
        went wrong."""
        if self._cached is not None:
            return self._cached
        parts = self._wait()
        self._keep(parts)
        return parts

    def _keep(self, parts: TokenizerParts) -> None:
        staged = None
        try:
            self._entry.parent.mkdir(parents=True, exist_ok=True)
            descriptor, name = tempfile.mkstemp(prefix=self._entry.stem, suffix=".tmp", dir=self._entry.parent)
            staged = Path(name)
            with os.fdopen(descriptor, "wb") as file:
                file.write(msgspec.json.encode(parts))
            staged.replace(self._entry)  # whole or not at all, whoever else writes the same entry
        except OSError as exc:
            log.warning("tokenizer not cached", entry=str(self._entry), error=str(exc))
            if staged is not None:
                staged.unlink(missing_ok=True)

    def _wait(self) -> TokenizerParts:
        try:
            _, stderr = self._child.communicate(timeout=BUILD_TIMEOUT_S)
            data = self._out.read_bytes()
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.communicate()
            raise TokenizerBuildError(f"building it took over {BUILD_TIMEOUT_S:.0f} s") from None
        except OSError as exc:
            raise TokenizerBuildError(f"its output could not be read ({exc})") from exc
        finally:
            self._out.unlink(missing_ok=True)
        try:
            parts = msgspec.json.decode(data, type=TokenizerParts) if data else None
        except (msgspec.DecodeError, msgspec.ValidationError):  # a child killed mid-write (out of memory, say)
            parts = None
        if parts is None or parts.error or self._child.returncode != 0:
            last = stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {self._child.returncode}"]
            raise TokenizerBuildError(parts.error if parts is not None and parts.error else last[0])
        return parts


    def cancel(self) -> None:
        """Stop the child (its tokenizer is no longer wanted) and remove its output."""
        if self._child is None:
            return
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

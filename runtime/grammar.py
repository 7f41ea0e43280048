"""Output constraints compiled with llguidance, and the per-sequence matchers the engine advances.

    GrammarCompiler.compile(StructuredOutputs) -> CompiledGrammar     (any thread; cached, bounded)
    CompiledGrammar.new_matcher() -> GrammarMatcher                   (one per sequence)
    GrammarMatcher.fill_bitmask(bitmask, row); .accept(token); .is_stopped

Why llguidance (not xgrammar): measured in bench/bench_grammar_engines.py (BENCHMARKS.md
section 14). On Qwen2's 151,936-token vocabulary it compiles a schema to its first mask
faster (median 1.1 ms vs 8.1 ms, worst 15 ms vs 34 ms); xgrammar fills a row's mask faster
(7 us vs 57 us: 0.3 ms vs 1.0 ms for a batch of 32), but either is under 1% of that batch's
~140 ms step, and llguidance installs with no dependencies where xgrammar pulls in
transformers and triton (and its own CPU mask kernel took 19 ms for those 32 rows). The bitmask is read by our own kernel
(kernels/token_mask.py: the allowed ids), whichever engine fills it.

A compiled grammar is a pristine matcher; a sequence's matcher is its copy (~10 us), so a
fork (n > 1) copies its parent's state and a cache hit skips the compile.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance
import llguidance.gbnf_to_lark
import structlog
import torch

from runtime.errors import InvalidRequestError
from runtime.structured_outputs import StructuredOutputs

log = structlog.get_logger(__name__)

JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: no unbounded runs of whitespace from a noisy model
DEFAULT_CACHE_SIZE = 256


class GrammarMatcher:
    """One sequence's position in its grammar."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] (int32 [rows, words], contiguous, CPU)."""
        _check_bitmask(bitmask)
        words = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar refuses it (the matcher is then in error)."""
        return self._matcher.consume_token(token_id)

    def num_valid(self, token_ids: list[int]) -> int:
        """How many of `token_ids`, in order from here, the grammar would accept (the state is not changed)."""
        return self._matcher.validate_tokens(token_ids)

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete and nothing may follow (or it accepted a stop token)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None

    def copy(self) -> GrammarMatcher:
        return GrammarMatcher(self._matcher.deep_copy())


_EXECUTOR: llguidance.LLExecutor | None = None  # llguidance's thread pool for a batch's masks (made on first use)


def fill_bitmasks(matchers: list[GrammarMatcher], bitmask: torch.Tensor) -> None:
    """bitmask[j] = the tokens matchers[j] allows next, for a whole batch at once.

    llguidance's executor computes the rows on its own threads, outside the GIL: the engine
    thread calls this between the forward and the draw, when the cores are otherwise idle.
    """
    global _EXECUTOR
    if len(matchers) == 1:
        matchers[0].fill_bitmask(bitmask, 0)
        return
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor(max(1, min(8, torch.get_num_threads())))
    _check_bitmask(bitmask)
    if bitmask.shape[0] < len(matchers):
        raise ValueError(f"a token bitmask of {bitmask.shape[0]} rows for {len(matchers)} matchers")
    _EXECUTOR.unsafe_compute_mask_ptr([(m._matcher, j) for j, m in enumerate(matchers)], bitmask.data_ptr(),
                                      bitmask.shape[1] * bitmask.element_size(), len(matchers))


def _check_bitmask(bitmask: torch.Tensor) -> None:
    """llguidance writes through the raw pointer: only a contiguous int32 [rows, words] CPU tensor will do.

    (Called directly rather than through llguidance.torch, whose import compiles a torch function and so
    loads torch's compiler stack: ~200 MB in every server process, for two pointer calls.)"""
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2 or not bitmask.is_contiguous():
        raise ValueError(f"a token bitmask is a contiguous int32 [rows, words] CPU tensor, not {bitmask.dtype} "
                         f"{tuple(bitmask.shape)} on {bitmask.device}")


class CompiledGrammar:
    """A constraint ready to run: matchers for it are copies of one pristine matcher."""

    __slots__ = ("key", "_pristine")

    def __init__(self, key: str, pristine: llguidance.LLMatcher) -> None:
        self.key = key
        self._pristine = pristine

    def new_matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._pristine.deep_copy())


class _ByteVocabulary:
    """The demo byte tokenizer as llguidance's TokenizerWrapper expects it (ids 0..255 bytes)."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [bytes([i]) for i in range(256)] + [b"<bos>", b"<eos>"] + [b""] * (vocab_size - 258)
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def _llg_tokenizer(tokenizer, vocab_size: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    tokenizer_json = getattr(tokenizer, "tokenizer_json", None)
    if tokenizer_json is not None:
        return llguidance.LLTokenizer(tokenizer_json(), n_vocab=vocab_size, eos_token=eos_token_ids)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary(tokenizer, vocab_size)),
                                  n_vocab=vocab_size, eos_token=eos_token_ids)


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a Lark string literal takes JSON's escapes


def grammar_source(spec: StructuredOutputs) -> str:
    """The llguidance grammar for a constraint (not yet checked)."""
    kind, value = spec.kind, spec.value
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(_lark_string(c) for c in value))
    if "::=" in value:  # GBNF, as llama.cpp and xgrammar (vLLM's default) take it
        try:
            value = llguidance.gbnf_to_lark.gbnf_to_lark(value)
        except Exception as exc:  # the converter raises its own error or plain ones on bad input
            raise InvalidRequestError(f"the GBNF grammar cannot be read: {exc}", param=spec.param) from exc
    return llguidance.LLMatcher.grammar_from_lark(value)


class GrammarCompiler:
    """Compiles constraints for one tokenizer; an LRU cache keyed by the constraint.

    Thread-safe: the service compiles on a worker thread, never on the event loop or the
    engine thread (only cached() runs there). Raises InvalidRequestError (the spec's param) for a constraint the
    engine cannot compile.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self._tokenizer = tokenizer
        self._eos_token_ids = sorted(eos_token_ids)
        self._llg: llguidance.LLTokenizer | None = None  # built by warm_up() or the first compile
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()  # the cache (held for microseconds: cached() runs on the event loop)
        self._index_lock = threading.Lock()  # building the vocabulary index (held for up to a second)
        self.num_compiled = 0  # cache misses, for tests and the bench

    def warm_up(self) -> None:
        """Build the index of the vocabulary now (the service does at start-up: 0.9 s for 150k tokens)."""
        with self._index_lock:
            if self._llg is None:
                self._llg = _llg_tokenizer(self._tokenizer, self.vocab_size, self._eos_token_ids)

    def cached(self, spec: StructuredOutputs) -> CompiledGrammar | None:
        """The compiled grammar if it is in the cache (cheap: safe on the event loop)."""
        key = spec.cache_key()
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
            return compiled

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """The compiled grammar for `spec`, from the cache or built now (~1 ms)."""
        compiled = self.cached(spec)
        if compiled is not None:
            return compiled
        try:
            source = grammar_source(spec)
        except ValueError as exc:
            raise InvalidRequestError(f"the {spec.kind} constraint is invalid: {exc}", param=spec.param) from exc
        self.warm_up()
        pristine = llguidance.LLMatcher(self._llg, source)
        if pristine.is_error():
            raise InvalidRequestError(f"the {spec.kind} constraint cannot be compiled: {pristine.get_error()}",
                                      param=spec.param)
        compiled = CompiledGrammar(spec.cache_key(), pristine)
        with self._lock:
            self.num_compiled += 1
            self._cache[compiled.key] = compiled
            self._cache.move_to_end(compiled.key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled


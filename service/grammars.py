"""Output constraints compiled off the event loop: the one async path the front door and workers share."""

from __future__ import annotations

import asyncio

from runtime.errors import InvalidRequestError
from runtime.grammar import CompiledGrammar, GrammarCompiler
from runtime.structured_outputs import StructuredOutputs


class LoopCompiles:
    """Compiles for one event loop: a cache hit is answered at once; a miss goes to the default
    executor, once however many requests bring the same new constraint meanwhile."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._in_flight: dict[str, asyncio.Future] = {}  # constraint cache key -> its compile

    async def compile(self, spec: StructuredOutputs | None) -> CompiledGrammar | None:
        """The compiled grammar of `spec` (None for None). Raises InvalidRequestError naming spec.param."""
        if spec is None:
            return None
        compiled = self.compiler.cached(spec)
        if compiled is not None:
            return compiled
        key = spec.cache_key()
        pending = self._in_flight.get(key)
        if pending is None:
            pending = self._in_flight[key] = asyncio.get_running_loop().run_in_executor(None, self.compiler.compile,
                                                                                         spec)
            pending.add_done_callback(lambda _: self._in_flight.pop(key, None))
        try:
            return await asyncio.shield(pending)  # a cancelled request leaves the compile to the others
        except InvalidRequestError as exc:  # one compile, but each request names its own field
            raise InvalidRequestError(exc.message, param=spec.param, code=exc.code) from exc

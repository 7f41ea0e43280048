"""When a sequence stops, checked once per appended token: the one place every stop rule lives.

In order: a stop token id; EOS (unless ignore_eos, and always where a grammar allows it: the
grammar may end there); a stop string (after min_tokens); the grammar refusing the token or
being complete; max_tokens or max_model_len. A sequence ending for a reason other than a stop
string flushes its held-back text, which may complete one.
"""

from __future__ import annotations

import structlog

from runtime.request import Sequence

log = structlog.get_logger(__name__)


def eos_stops(seq: Sequence, token_id: int, eos_token_ids: frozenset[int]) -> bool:
    """Whether `token_id` is an EOS that ends `seq`: unless ignore_eos, and always where a grammar allows it (a
    grammar allows EOS only where it may end: it ends there, whatever ignore_eos says)."""
    return token_id in eos_token_ids and (not seq.params.ignore_eos or seq.grammar is not None)


def stops_on_token(seq: Sequence, token_id: int, eos_token_ids: frozenset[int]) -> bool:
    """Whether appending `token_id` ends `seq` by the token alone (a stop token id, or EOS as eos_stops says):
    the rules check_stop applies first, asked before the token is appended (a verification's walk)."""
    return token_id in seq.params.stop_token_ids or eos_stops(seq, token_id, eos_token_ids)


def check_stop(seq: Sequence, token_id: int, eos_token_ids: frozenset[int],
               max_model_len: int) -> tuple[str | None, int | str | None]:
    """(finish reason, stop reason) after `token_id` was appended to `seq` (its detokenizer and grammar fed
    here), or (None, None) while it runs on."""
    params = seq.params
    reason, stop_reason = None, None
    if token_id in params.stop_token_ids:
        reason, stop_reason = "stop", token_id
        seq.detokenizer.append_silent()
    elif eos_stops(seq, token_id, eos_token_ids):
        reason = "stop"
        seq.detokenizer.append_silent()
    else:
        # min_tokens: no stop string ends the output before it (EOS and stop ids are not sampled there)
        stop_string = seq.detokenizer.append(token_id, check_stop=seq.num_output_tokens > params.min_tokens)
        if stop_string is not None:
            reason, stop_reason = "stop", stop_string
    grammar = seq.grammar
    if grammar is not None and reason is None:
        if not grammar.accept(token_id):  # the mask allowed it, so the grammar engine is at fault: end cleanly
            log.warning("grammar refused a sampled token; ending the sequence", seq_id=seq.seq_id,
                        token_id=token_id, error=grammar.error)
            reason = "stop"
        elif grammar.is_stopped:  # complete, and nothing may follow
            reason = "stop"
    if reason is None and (seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= max_model_len):
        reason = "length"
    if reason is not None and not isinstance(stop_reason, str):
        stop_string = seq.detokenizer.flush()  # held bytes may complete a stop string
        if stop_string is not None:
            reason, stop_reason = "stop", stop_string
    return reason, stop_reason


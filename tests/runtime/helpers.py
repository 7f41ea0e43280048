"""Small builders for runtime unit tests (no model needed)."""

from runtime.detokenizer import IncrementalDetokenizer
from runtime.request import Request, Sequence
from runtime.sampling_params import SamplingParams


def make_seq(request_id: str, token_ids: list[int], salt: bytes | None = None, **params) -> Sequence:
    request = Request(request_id, None, list(token_ids), SamplingParams(**params), salt)
    seq = Sequence(request, 0, list(token_ids), IncrementalDetokenizer(None, token_ids))
    request.sequences.append(seq)
    return seq

"""Prompt lookup and Predicted Outputs drafts, on token lists (no model)."""

from __future__ import annotations

import pytest

from config import SpeculativeConfig
from config.settings import SPECULATIVE_METHODS
from runtime.request import Request, Sequence
from runtime.sampling_params import SamplingParams
from runtime.speculative.ngram import NgramIndex
from runtime.speculative.proposers import PROPOSERS, NgramProposer, PredictionProposer, SuffixProposer
from runtime.speculative.speculator import Speculator
from tests.runtime.helpers import make_seq


def test_the_longest_suffix_seen_before_proposes_what_followed_its_latest_occurrence():
    index = NgramIndex(1, 3)
    # "5 6 7" occurs once (followed by 8 9); "6 7" alone later (followed by 1)
    tokens = [5, 6, 7, 8, 9, 6, 7, 1, 2, 5, 6, 7]
    assert index.propose(tokens, 3) == [8, 9, 6]  # the 3-gram wins over the later 2-gram
    assert index.propose([1, 2, 3, 4], 2) == []  # no suffix seen before
    assert NgramIndex(2, 3).propose([4, 1, 9, 1], 2) == []  # a 1-gram match is below prompt_lookup_min


def test_the_index_grows_with_the_tokens_and_a_repeat_drafts_its_whole_period():
    index = NgramIndex(1, 2)
    tokens = [3, 4, 3]
    assert index.propose(tokens, 5) == [4, 3, 4, 3, 4]  # runs past the end: continues from its own drafts
    tokens += [9, 3]
    assert index.propose(tokens, 2) == [9, 3]  # "3" was last followed by 9, and "9 3" by nothing yet: latest wins


def test_ngram_proposer_keeps_one_index_per_sequence_and_forgets_it():
    proposer = NgramProposer(1, 4)
    a, b = make_seq("a", [1, 2, 3, 1, 2]), make_seq("b", [7, 8, 7])
    assert proposer.propose(a, 2) == [3, 1] and proposer.propose(b, 1) == [8]
    proposer.forget(a)
    assert set(proposer.indexes) == {"b"}


def _seq_with_prediction(predicted: list[int], outputs: list[int]) -> Sequence:
    prompt = [100, 101]
    request = Request("r", None, prompt, SamplingParams(max_tokens=50), None, prediction_token_ids=predicted)
    seq = Sequence(request, 0, prompt + outputs, None)
    request.sequences.append(seq)
    return seq


def test_a_prediction_drafts_its_next_tokens_while_the_output_follows_it():
    predicted = [10, 11, 12, 13, 14, 15]
    proposer = PredictionProposer()
    seq = _seq_with_prediction(predicted, [])
    assert proposer.propose(seq, 3) == [10, 11, 12]
    seq.token_ids += [10, 11]
    assert proposer.propose(seq, 3) == [12, 13, 14]
    seq.token_ids += [12, 13, 14, 15]
    assert proposer.propose(seq, 3) == []  # the prediction is used up


def test_a_prediction_realigns_where_the_output_rejoins_it_after_an_edit():
    predicted = [10, 11, 12, 13, 14, 15, 16, 17]
    proposer = PredictionProposer()
    seq = _seq_with_prediction(predicted, [10, 11])
    assert proposer.propose(seq, 2) == [12, 13]
    seq.token_ids += [99, 98, 13, 14]  # an edit replaced 12, then the text goes on as predicted
    assert proposer.propose(seq, 2) == [15, 16]
    seq.token_ids += [50, 51]  # wanders off: nothing in the prediction ends with "50 51"
    assert proposer.propose(seq, 2) == []
    assert proposer.propose(_seq_with_prediction([], [1]), 2) == []  # no prediction: no drafts


def test_a_paraphrase_that_rejoins_at_one_word_is_guessed_there_as_its_own_source():
    predicted = [10, 11, 12, 13, 14, 15, 16, 11, 17]
    proposer = PredictionProposer()
    seq = _seq_with_prediction(predicted, [10, 11])
    assert proposer.propose(seq, 2) == [12, 13] and proposer.source == "prediction"
    seq.token_ids += [99, 14]  # "help before then" -> "assistance before ...": one word in common, no 2-gram
    assert proposer.propose(seq, 3) == [15, 16, 11] and proposer.source == "prediction_guess"
    seq.token_ids += [15, 16]  # the guess was right: the 2-gram "15 16" realigns, and the prediction drafts again
    assert proposer.propose(seq, 2) == [11, 17] and proposer.source == "prediction"
    lost = _seq_with_prediction(predicted, [10, 11, 12, 13, 14, 88, 11])
    # "11" occurs in the prediction before where the output last followed it (at 1) and after it (at 7)
    proposer = PredictionProposer()
    assert proposer.propose(lost, 1) == [17] and proposer.source == "prediction_guess"
    behind = _seq_with_prediction(predicted, [10, 11, 12, 13, 14, 15, 16, 11, 88, 10])
    assert PredictionProposer().propose(behind, 2) == []  # "10" only before the last aligned place: no guess


def test_a_lost_step_does_not_forget_where_the_output_last_followed_the_prediction():
    predicted = [1, 2, 3, 4, 1, 2, 5, 6]  # "1 2" twice
    proposer = PredictionProposer()
    seq = _seq_with_prediction(predicted, [1, 2, 3, 4, 1, 2, 9])
    assert proposer.propose(seq, 2) == []  # lost; "9" is nowhere in the prediction
    seq.token_ids += [1, 2]
    assert proposer.propose(seq, 2) == [5, 6]  # the "1 2" after the last aligned place, not the first one


@pytest.mark.parametrize("bad", [(0, 2), (3, 2)])
def test_lookup_bounds_are_checked(bad):
    with pytest.raises(ValueError):
        NgramIndex(*bad)


def test_every_configured_method_has_its_maker_and_the_speculator_holds_the_one_named():
    assert set(SPECULATIVE_METHODS) == set(PROPOSERS) | {"draft_model"}  # the engine makes a draft model's
    assert isinstance(Speculator(SpeculativeConfig(method="ngram")).proposer, NgramProposer)
    assert isinstance(Speculator(SpeculativeConfig(method="suffix")).proposer, SuffixProposer)
    assert Speculator(None).proposer is None

"""Sampling: filters and penalties exactly, seeds reproducible in any batch, logprobs vs transformers."""

import math
import random

import pytest
import torch

from runtime import Engine, SamplingParams
from runtime.sampler import apply_penalties, filter_logits
from tests.runtime.helpers import make_seq


@pytest.fixture(scope="module")
def engine(stories_dir):
    return Engine.from_pretrained(stories_dir, num_blocks=256)


def _prompt(seed: int, n: int = 12) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 512) for _ in range(n)]


def test_top_k_keeps_exactly_k():
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0])
    kept = filter_logits(logits, top_k=2, top_p=1.0, min_p=0.0)
    assert torch.isfinite(kept).tolist() == [False, True, True, False]


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.isfinite(filter_logits(logits, 0, 0.79, 0.0)).tolist() == [True, True, False, False]
    assert torch.isfinite(filter_logits(logits, 0, 0.81, 0.0)).tolist() == [True, True, True, False]
    assert torch.isfinite(filter_logits(logits, 0, 0.01, 0.0)).tolist() == [True, False, False, False]


def test_min_p_drops_tokens_below_a_share_of_the_best():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.isfinite(filter_logits(logits, 0, 1.0, 0.25)).tolist() == [True, True, True, False]


def test_penalties_match_their_formulas():
    seq = make_seq("p", [0, 1], repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    seq.token_ids += [2, 2, 3]  # outputs: 2 twice, 3 once
    logits = torch.tensor([2.0, -2.0, 1.0, 1.0, 1.0])
    out = apply_penalties(logits, seq)
    # repetition over prompt+output: positive / 2, negative * 2; then output counts
    expected = [1.0, -4.0, 0.5 - 0.5 - 0.5, 0.5 - 0.5 - 0.25, 1.0]
    assert out.tolist() == pytest.approx(expected)


def test_penalty_counts_kept_as_tokens_arrive_equal_a_fresh_count():
    params = dict(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25)
    seq = make_seq("p", [0, 1], **params)
    logits = torch.tensor([2.0, -2.0, 1.0, 1.0, 1.0])
    apply_penalties(logits, seq)  # counts are made here, then kept up to date
    for token in (4, 2, 4):
        seq.append_token(token)
    child = seq.fork(1, seq.detokenizer.copy())
    child.append_token(3)  # the fork's counts are its own
    fresh = make_seq("q", [0, 1], **params)
    fresh.token_ids += [4, 2, 4]
    assert apply_penalties(logits, seq).tolist() == pytest.approx(apply_penalties(logits, fresh).tolist())
    fresh.token_ids.append(3)
    fresh.penalty_counts = None
    assert apply_penalties(logits, child).tolist() == pytest.approx(apply_penalties(logits, fresh).tolist())



@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (the CPU case runs everywhere)"))])
def test_penalty_counts_live_on_the_logits_device_and_kept_counts_equal_fresh_ones(device):
    seq = make_seq("p", [0, 1], repetition_penalty=1.5, presence_penalty=0.5)
    logits = torch.tensor([2.0, -2.0, 1.0, 1.0, 1.0], device=device)
    out = apply_penalties(logits, seq)
    seq.append_token(3)
    assert out.device == logits.device and seq.penalty_counts.seen.device == logits.device
    fresh = make_seq("q", [0, 1], repetition_penalty=1.5, presence_penalty=0.5)
    fresh.token_ids.append(3)  # an output token, counted from scratch (on the CPU)
    assert apply_penalties(logits, seq).cpu().tolist() == pytest.approx(apply_penalties(logits.cpu(), fresh).tolist())

def test_top_k_one_equals_greedy(engine):
    prompt = _prompt(1)
    greedy = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    top1 = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=1.3, top_k=1, seed=3, ignore_eos=True))[0]
    assert top1.outputs[0].token_ids == greedy.outputs[0].token_ids


def test_seeded_sampling_is_the_same_alone_and_in_any_batch(engine):
    target = SamplingParams(max_tokens=25, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    prompt = _prompt(2)
    alone = engine.generate([prompt], target)[0].outputs[0].token_ids
    others = [
        SamplingParams(max_tokens=30, temperature=0.8, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=1.0, seed=99, ignore_eos=True),
        SamplingParams(max_tokens=17, temperature=0, ignore_eos=True),
    ]
    batch = engine.generate([_prompt(3, 40), prompt, _prompt(4, 3), _prompt(5, 70)], [others[0], target, others[1], others[2]])
    assert batch[1].outputs[0].token_ids == alone
    reordered = engine.generate([prompt, _prompt(6, 20)], [target, others[0]])
    assert reordered[0].outputs[0].token_ids == alone
    other_seed = SamplingParams(max_tokens=25, temperature=1.0, top_p=0.95, seed=4321, ignore_eos=True)
    assert engine.generate([prompt], other_seed)[0].outputs[0].token_ids != alone


def test_logprobs_match_transformers(stories_dir, engine):
    from transformers import AutoModelForCausalLM

    prompt = _prompt(7)
    out = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0, logprobs=3, ignore_eos=True))[0].outputs[0]
    model = AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0]
    reference = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # [8, vocab]
    for i, (token_id, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert list(entry)[0] == token_id and len(entry) == 3  # chosen first; greedy: it is also the top 1
        for tid, value in entry.items():
            assert value == pytest.approx(float(reference[i, tid]), abs=1e-4)
    assert out.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(out.token_ids, out.logprobs)))


def test_sampled_tokens_follow_the_distribution():
    from runtime.sampler import Sampler

    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.log(probs)[None, :]
    seq = make_seq("d", [0], temperature=1.0, seed=5)
    sampler = Sampler()
    counts = [0, 0, 0]
    for _ in range(3000):
        counts[sampler(logits, [seq])[0][0]] += 1
    for count, p in zip(counts, probs.tolist()):
        assert abs(count / 3000 - p) < 4 * math.sqrt(p * (1 - p) / 3000)


def test_a_token_of_probability_zero_is_never_drawn():
    from runtime.sampler import Sampler

    logits = torch.full((1, 64), float("-inf"))
    logits[0, [0, 63]] = torch.tensor([0.5, 0.0])  # the edges: the first and last tokens are the only ones allowed
    seq = make_seq("z", [0], temperature=1.0, seed=1)
    sampler = Sampler()
    drawn = {sampler(logits, [seq])[0][0] for _ in range(2000)}
    assert drawn == {0, 63}


class _AllowOnly:
    """A stand-in grammar matcher that allows a fixed set of token ids."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = [0] * bitmask.shape[1]
        for t in self.ids:
            words[t // 32] |= 1 << (t % 32)
        bitmask[row] = torch.tensor(words, dtype=torch.int64).to(torch.uint32).view(torch.int32)


def test_a_constrained_row_draws_only_allowed_ids_greedy_or_not_and_others_are_untouched(monkeypatch):
    import runtime.sampler
    from runtime.sampler import Sampler

    def fill_each(matchers, bitmask):  # llguidance's batch fill needs real matchers: fill the stand-ins one by one
        for j, matcher in enumerate(matchers):
            matcher.fill_bitmask(bitmask, j)

    monkeypatch.setattr(runtime.sampler, "fill_bitmasks", fill_each)

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 300, generator=generator)
    allowed = [3, 77, 250]
    greedy = make_seq("g", [0], temperature=0.0)
    sampled = make_seq("s", [0], temperature=1.0, seed=2, repetition_penalty=1.3)
    free = make_seq("f", [0], temperature=0.0)
    empty = make_seq("e", [0], temperature=0.0)
    greedy.grammar, sampled.grammar, empty.grammar = _AllowOnly(allowed), _AllowOnly(allowed), _AllowOnly([])
    sampler = Sampler()
    for _ in range(50):
        tokens, _ = sampler(logits, [greedy, sampled, free, empty])
        assert tokens[0] == allowed[int(logits[0, allowed].argmax())]
        assert tokens[1] in allowed
        assert tokens[2] == int(logits[2].argmax()) and tokens[3] == int(logits[3].argmax())  # empty: unconstrained
    mixed, _ = sampler(logits[:2], [free, greedy])  # the greedy fast path with a constrained row in it
    assert mixed == [int(logits[0].argmax()), allowed[int(logits[1, allowed].argmax())]]


@pytest.mark.parametrize("scale", [0.3, 2.0, 8.0])  # flat rows (top_p needs more than the candidates), peaked rows
def test_batched_filters_keep_what_a_full_sort_of_each_row_keeps(scale):
    """ops.filter_rows ranks only a row's best candidates for top_p (its top_k, or TOP_P_CANDIDATES): the kept
    set equals a full sort of that row alone, for rows with and without each filter, in one batch."""
    from runtime.sampling import ops

    def alone(row: torch.Tensor, k: int, p: float, m: float) -> torch.Tensor:
        if 0 < k < row.shape[0]:
            row = row.masked_fill(row < torch.topk(row, k).values[-1], float("-inf"))
        if p < 1.0:
            ordered, order = torch.sort(row, descending=True)
            probs = torch.softmax(ordered, dim=-1)
            drop = torch.cumsum(probs, dim=-1) - probs >= p
            drop[0] = False
            row = row.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        if m > 0.0:
            probs = torch.softmax(row, dim=-1)
            row = row.masked_fill(probs < m * probs.max(), float("-inf"))
        return row

    vocab = 3 * ops.TOP_P_CANDIDATES
    settings = [(0, 0.9, 0.0), (40, 0.8, 0.0), (0, 1.0, 0.0), (vocab, 0.3, 0.05), (7, 1.0, 0.1), (0, 0.5, 0.02)]
    for seed in range(20):
        rows = torch.randn(len(settings), vocab, generator=torch.Generator().manual_seed(seed)) * scale
        out = ops.filter_rows(rows, torch.tensor([k for k, _, _ in settings]),
                              torch.tensor([[p] for _, p, _ in settings]), torch.tensor([[m] for _, _, m in settings]))
        for i, (k, p, m) in enumerate(settings):
            assert torch.equal(torch.isfinite(out[i]), torch.isfinite(alone(rows[i], k, p, m))), (seed, settings[i])

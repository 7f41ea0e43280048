"""The draft policy: drafts where they raise tokens per second, none where the step is compute-bound."""

from __future__ import annotations

import pytest

from runtime.speculative.policy import DRAFT_MARGIN, StepCostModel, plan_drafts


def _geometric(a: float, k: int) -> list[float]:
    return [a ** j for j in range(1, k + 1)]


def test_a_memory_bound_single_stream_drafts_up_to_its_cap():
    # one token costs t0 = 10 ms, one more 0.1 ms: any acceptance worth having pays
    assert plan_drafts([_geometric(0.6, 4)], num_base_tokens=1, num_emitting=1, cost=(0.010, 0.0001)) == [4]


def test_a_compute_bound_batch_drafts_nothing():
    # 64 decodes, each token 1 ms on top of a 10 ms step: a draft would need to be accepted more than ~0.85 of the time
    assert plan_drafts([_geometric(0.8, 4)] * 64, num_base_tokens=64, num_emitting=64, cost=(0.010, 0.001)) == [0] * 64


def test_drafts_go_to_the_sequences_that_accept_them():
    counts = plan_drafts([_geometric(a, 4) for a in (0.95, 0.1, 0.7)], num_base_tokens=3, num_emitting=3,
                         cost=(0.010, 0.001))
    assert counts[0] == 4 and counts[1] == 0 and 0 < counts[2] < 4


def test_a_draft_that_only_breaks_even_by_the_estimates_is_not_made():
    # one stream, t1 / t0 = 10%: a draft kept 11% of the time adds 0.11 tokens for 1 ms on an 11 ms step
    cost = (0.010, 0.001)
    assert plan_drafts([[0.11]], 1, 1, cost) == [0]
    assert plan_drafts([[0.11 * DRAFT_MARGIN * 1.05]], 1, 1, cost) == [1]


def test_a_run_that_fails_early_or_not_at_all_drafts_long():
    """First draft kept half the time, but once kept the rest follow (copying): worth more than 0.5 ** j."""
    cost = (0.010, 0.001)
    assert plan_drafts([_geometric(0.5, 8)], 1, 1, cost) == [2]
    assert plan_drafts([[0.5 * 0.97 ** j for j in range(8)]], 1, 1, cost) == [8]


def test_the_cost_model_learns_the_clock_from_steps_of_different_sizes():
    model = StepCostModel(relative_token_cost=0.5)  # a wrong prior
    for i in range(400):
        tokens = 1 + (i * 7) % 40
        model.observe(tokens, 0.020 + 0.0005 * tokens)
    t0, t1 = model.coefficients()
    assert t0 == pytest.approx(0.020, rel=0.05) and t1 == pytest.approx(0.0005, rel=0.05)


def test_the_cost_model_learns_a_slope_far_above_its_prior():
    model = StepCostModel(relative_token_cost=0.002)  # the prior says tokens are nearly free; they are not
    for i in range(400):
        tokens = 1 + (i * 7) % 40
        model.observe(tokens, 0.002 + 0.001 * tokens)  # steps far above the prediction at first: held, not ignored
    t0, t1 = model.coefficients()
    assert t0 == pytest.approx(0.002, rel=0.05) and t1 == pytest.approx(0.001, rel=0.05)


def test_the_first_step_of_a_process_does_not_turn_drafting_off():
    """Measured on stories260K: a cold 28-token first prompt takes 18 ms, warm decodes 1.7 ms."""
    model = StepCostModel(relative_token_cost=0.02)
    model.observe(28, 0.018)
    for _ in range(10):
        model.observe(1, 0.0017)
    assert plan_drafts([_geometric(0.5, 4)], 1, 1, model.coefficients())[0] >= 1
    fitted_alone = StepCostModel(relative_token_cost=0.02)
    fitted_alone.WARMUP_STEPS = 0  # what the fit said when it took the first step in
    fitted_alone.OUTLIER_RATIO = float("inf")
    for tokens, seconds in [(28, 0.018)] + [(1, 0.0017)] * 10:
        fitted_alone.observe(tokens, seconds)
    assert plan_drafts([_geometric(0.5, 4)], 1, 1, fitted_alone.coefficients())[0] == 0


def test_one_stalled_step_does_not_steer_the_fit_for_long():
    model = StepCostModel(relative_token_cost=0.02)
    for i in range(200):
        model.observe(1 + i % 5, 0.002 + 0.00005 * (1 + i % 5))
    model.observe(5, 0.040)  # the machine stalled for this one step (20x its time)
    t0, t1 = model.coefficients()
    assert t1 < 0.0005  # held to 3x its prediction, it moves the slope by a few tenths of a ms at most
    assert plan_drafts([_geometric(0.7, 4)], 1, 1, (t0, t1))[0] >= 1


def test_before_any_step_the_prior_sets_the_shape():
    t0, t1 = StepCostModel(relative_token_cost=0.02).coefficients()
    assert t1 / t0 == pytest.approx(0.02)
    model = StepCostModel(relative_token_cost=0.02)
    for _ in range(50):
        model.observe(1, 0.010)  # one size only: the slope cannot be seen, the prior's ratio holds
    t0, t1 = model.coefficients()
    assert t0 == pytest.approx(0.010, rel=0.05) and t1 / t0 == pytest.approx(0.02, rel=0.2)


def test_a_draft_that_costs_a_forward_to_make_gets_fewer_slots_than_a_free_one():
    """Same acceptance, but one candidate's drafts each cost a draft model's forward: it ranks and stops earlier."""
    cost = (0.010, 0.0005)  # t0 10 ms, t1 0.5 ms
    gains = [[0.9, 0.8, 0.7, 0.6], [0.9, 0.8, 0.7, 0.6]]
    free, drafted = plan_drafts(gains, 2, 2, cost, [0.0, 0.001])
    assert free == 4 and 0 < drafted < 4
    assert plan_drafts(gains, 2, 2, cost, [0.0, 0.05]) == [4, 0]  # a draft as dear as five steps never pays
    assert plan_drafts(gains, 2, 2, cost) == plan_drafts(gains, 2, 2, cost, [0.0, 0.0])


def test_a_seeded_sampled_request_drafts_whatever_the_clock_says(stories_dir):
    """The policy would draft nothing (a step's every token as dear as the step): an unseeded request drafts
    nothing, a seeded sampled one all its method proposes, so its seed reproduces it whatever the timing."""
    from runtime import SamplingParams
    from tests.runtime.speculative.engine_helpers import NGRAM, engine, run

    story = "Lily and Tom went to the park. Lily and Tom saw a big tree. Lily and Tom"
    drafted = {}
    for name, seed in (("unseeded", None), ("seeded", 3)):
        spec = engine(stories_dir, NGRAM)
        spec.speculator.cost.coefficients = lambda: (0.001, 1.0)
        run(spec, [spec.tokenizer.encode(story)], SamplingParams(max_tokens=30, temperature=0.8, seed=seed))
        drafted[name] = spec.speculator.stats.num_draft_tokens
    assert drafted["unseeded"] == 0 and drafted["seeded"] > 0


def test_a_draft_position_never_reached_borrows_the_rate_of_the_one_before_it():
    """A source verified only 3 drafts at a time, all kept: its later positions are estimated at its
    observed rate, not held at the prior (else it would never try them, and never learn they pay)."""
    from runtime.speculative.speculator import Speculator
    from tests.runtime.helpers import make_seq

    speculator = Speculator(None)  # `prediction` only: k = 8
    seq = make_seq("a", [1, 2, 3], max_tokens=100)
    for _ in range(20):
        speculator.record(seq, "prediction", 3, 3)
    gains = speculator._gains(seq, "prediction", 8)
    observed = speculator.source_continuation["prediction"]
    assert observed[1] > 0.9 and observed[2] > 0.9 and observed[3] == speculator.prior  # position 3 never reached
    assert gains[3] == pytest.approx(gains[2] * observed[2]) and gains[7] > 0.5
    speculator.record(seq, "prediction", 5, 3)  # now position 3 was reached, and refused: it has its own rate
    gains = speculator._gains(seq, "prediction", 8)
    assert gains[3] < gains[2] * speculator.source_continuation["prediction"][2]

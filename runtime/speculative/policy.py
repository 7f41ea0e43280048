r"""How many drafts each sequence verifies this step: only as many as pay for themselves.

A step that computes T tokens takes about t0 + t1 * T seconds (t0: reading the weights, the
fixed part; t1: one more token's compute). The engine times its steps and fits both
(`StepCostModel`, least squares with exponential forgetting, held near a prior until steps of
different sizes have been seen). The fit leaves out the engine's first step, which pays the
process's one-time costs (first touch of the weights, the kernels' first calls: 18 ms against a
warm 2.7 ms for stories260K's first 28-token prompt, which fitted alone said no draft pays for the
next hundred steps), and holds any step to OUTLIER_RATIO times what the fit predicted for it, so a
step stalled by the machine cannot steer the policy for long.

A sequence gets its j-th draft's token with probability g_j (every earlier draft must be kept
too). Drafting raises a step's expected output E by g_j and its time t by t1, so it pays while
g_j / t1 > E / t: the step's tokens per second rise. `plan_drafts` hands out draft slots
best-first while that holds by a margin (g_j / t1 > DRAFT_MARGIN * E / t): a draft that only
breaks even by the estimates is a loss once they are a little off, and costs outside the
timed step (proposing, the bookkeeping) are not in t1:

    single stream (t1 << t0):   nearly any draft pays, k stays at its cap
    64 decodes (t1 * T >> t0):  E / t ~ 1 / t1, so a draft needs g_j > ~1: none are made

g_j = a * c_2 * ... * c_j (speculator.py): a, the sequence's own rate of keeping its first
draft (an average over its verified steps, starting from its draft source's), and c_i, the
source's rate of keeping draft i once draft i - 1 was kept. Copy-like drafts fail early or
run long (c_i near 1), which a single rate per token would miss.
"""

from __future__ import annotations

DRAFT_MARGIN = 1.5  # a draft must be expected to give this many times what its compute costs


class StepCostModel:
    """Fits seconds = t0 + t1 * tokens over recent steps (exponentially weighted least squares)."""

    DECAY = 0.98  # weight of the past per observed step
    PRIOR_SPREAD = 16.0  # tokens squared: how much spread in step sizes the prior's slope is worth
    WARMUP_STEPS = 1  # the engine's first steps, not fitted: they pay one-time costs
    OUTLIER_RATIO = 3.0  # a step is fitted as at most this many times its predicted seconds

    def __init__(self, relative_token_cost: float) -> None:
        self.relative_token_cost = relative_token_cost  # t1 / t0 before any step is timed
        self._sums = [0.0] * 5  # weighted n, sum x, sum y, sum xx, sum xy
        self._num_steps = 0

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One step's size and wall time (the first WARMUP_STEPS are skipped; stalls are held down)."""
        self._num_steps += 1
        if self._num_steps <= self.WARMUP_STEPS:
            return
        s = self._sums
        if s[0] > 0.0:
            t0, t1 = self.coefficients()
            seconds = min(seconds, self.OUTLIER_RATIO * (t0 + t1 * num_tokens))
        for i in range(5):
            s[i] *= self.DECAY
        x, y = float(num_tokens), seconds
        s[0] += 1.0
        s[1] += x
        s[2] += y
        s[3] += x * x
        s[4] += x * y

    def coefficients(self) -> tuple[float, float]:
        """(t0, t1) in seconds: the fitted line, its slope held toward the prior's until the sizes vary.

        The slope is a ridge estimate, (cov(x, y) + r * prior_t1) / (var(x) + r), with r worth
        PRIOR_SPREAD tokens squared: steps of one size only (var 0) keep the prior's t1 / t0
        ratio, scaled to their mean time; a few steps of different sizes outweigh it.
        """
        n, sx, sy, sxx, sxy = self._sums
        if n <= 0.0:
            return 1.0, self.relative_token_cost
        mean_x, mean_y = sx / n, sy / n
        prior_t1 = mean_y / (1.0 + self.relative_token_cost * mean_x) * self.relative_token_cost
        var_x = max(sxx - n * mean_x * mean_x, 0.0)
        cov_xy = sxy - n * mean_x * mean_y
        t1 = max((cov_xy + self.PRIOR_SPREAD * prior_t1) / (var_x + self.PRIOR_SPREAD), 0.0)
        t0 = max(mean_y - t1 * mean_x, 1e-9)
        return t0, t1


def plan_drafts(gains: list[list[float]], num_base_tokens: int, num_emitting: int,
                cost: tuple[float, float], extra_costs: list[float] | None = None) -> list[int]:
    """Drafts per candidate sequence: slots best-first, while each raises expected tokens per second.

    gains[i][j]: the probability that candidate i's draft j + 1 is kept (all before it kept too),
    non-increasing in j; its length is the most i may verify. num_base_tokens: the step's tokens
    without drafts; num_emitting: sequences that emit a token this step anyway; cost: (t0, t1)
    from StepCostModel; extra_costs[i]: seconds making one of candidate i's drafts costs (a draft
    model's forward; 0 for lookups), so its slot costs t1 + extra_costs[i] and ranks by gain per cost.
    """
    t0, t1 = cost
    extra = extra_costs or [0.0] * len(gains)
    time = t0 + t1 * num_base_tokens
    expected = float(num_emitting)
    slots = sorted(((gain / max(t1 + extra[i], 1e-12), gain, i) for i, row in enumerate(gains) for gain in row),
                   reverse=True)
    num_drafts = [0] * len(gains)
    for _, gain, i in slots:
        slot_cost = t1 + extra[i]
        if gain * time <= DRAFT_MARGIN * expected * slot_cost:  # tokens per second would not rise enough (nor for the rest)
            break
        num_drafts[i] += 1
        expected += gain
        time += slot_cost
    return num_drafts

"""A tenant cannot tell from its own clock, its own usage or the router whether another tenant's prompt is cached.

bench/side_channel.py's attack, on real processes: an attacker times 200 probes that begin with
a victim's cached secret and 200 that do not, interleaved. Per deployment (one server; two
replicas sharing a Redis prefix index; two workers behind Dynamo's KV-aware router):

- salted (the victim's own secret): a two-sample KS test cannot tell hit probes from miss
  probes (p > 0.05), no probe reports cached tokens, and no prefix index shows the attacker
  any of the secret's blocks; behind Dynamo, hit probes are not routed to the victim's worker
  more than miss probes are;
- control (an operator-shared prefix, one scope on purpose): the same probes do see the hit
  (p < 0.001, cached tokens on every hit probe), so the check above could see a leak.

With no leak, p is uniform: one attack in 20 falls under 0.05 by chance. A salted attack under
0.05 is therefore run once more with fresh probes, and both must fall under 0.05 to fail
(by chance: 1 in 400; a leak as large as the control's gives p < 1e-12 every time).
"""

from __future__ import annotations

import pytest

from bench.side_channel import DEPLOYMENTS, SECRET_TEXT, attack, index_view, start

NUM_PROBES = 200  # of each kind, per attack
NUM_CONTROL_PROBES = 60  # a hit is plain to see: 60 of each kind give p < 1e-10 (bench/side_channel.py runs 500)
ALPHA = 0.05


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_an_attacker_cannot_tell_a_victims_cached_prompt_from_its_clock(name, stories_dir, tmp_path):
    deployment = start(name, stories_dir, tmp_path)
    try:
        salted = attack(deployment, stories_dir, "salted", NUM_PROBES, seed=0)
        view = index_view(deployment, SECRET_TEXT)  # while the victim's pages are surely cached
        retried = attack(deployment, stories_dir, "salted", NUM_PROBES, seed=2) if salted.ks_p <= ALPHA else None
        control = attack(deployment, stories_dir, "control", NUM_CONTROL_PROBES, seed=1)
    finally:
        deployment.stop()

    assert all(cached > 0 for cached in salted.victim_cached[1:]), "the victim's pages left the cache mid-attack"
    assert not any(salted.hit_cached) and not any(salted.miss_cached), "a probe's usage showed another tenant's pages"
    assert max(view["victim"].values()) > 0 and not any(view["attacker"].values()), view
    assert salted.ks_p > ALPHA or retried.ks_p > ALPHA, (salted.summary(), retried.summary())

    # every hit probe found the shared pages, but the first on a replica the victim never used (nothing there yet)
    assert sum(not cached for cached in control.hit_cached) < len(deployment.urls), control.summary()
    assert not any(control.miss_cached), control.summary()
    assert control.ks_p < 0.001, control.summary()  # the probe sees a hit when there is one

    if name == "dynamo":  # the router: guesses of the victim's prompt do not follow the victim's pages
        assert -1 not in salted.hit_workers + salted.miss_workers  # every probe was placed on one worker
        shares = {kind: salted.victim_worker_share(kind) for kind in ("hit", "miss")}
        assert abs(shares["hit"] - shares["miss"]) < 0.2, shares  # ~4 standard deviations at 200 probes
        # control: shared pages do draw the router, so the share above could see routing by pages
        assert control.victim_worker_share("hit") > control.victim_worker_share("miss") + 0.2, control.summary()

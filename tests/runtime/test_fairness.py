"""Fair scheduling across tenants (virtual token counters): the counters, the queue, and the scheduler using them."""

from __future__ import annotations

import itertools

import pytest

from runtime.detokenizer import IncrementalDetokenizer
from runtime.fairness import FairQueue, FcfsQueue, VirtualTokenCounters
from runtime.kv_cache_manager import KVCacheManager
from runtime.request import Request, Sequence, SequenceStatus
from runtime.sampling_params import SamplingParams
from runtime.scheduler import Scheduler

BS = 4
_token_base = itertools.count(10_000, 1000)


def make_seq(request_id: str, prompt: int | list[int], tenant: str = "a", weight: float = 1.0, priority: int = 0,
             max_tokens: int = 1000) -> Sequence:
    token_ids = list(prompt) if isinstance(prompt, list) else [next(_token_base) + i for i in range(prompt)]
    request = Request(request_id, None, token_ids, SamplingParams(max_tokens=max_tokens), tenant.encode(),
                      tenant=tenant, tenant_weight=weight, priority=priority)
    seq = Sequence(request, 0, list(token_ids), IncrementalDetokenizer(None, token_ids))
    request.sequences.append(seq)
    return seq


def make_scheduler(policy: str, num_blocks=256, max_num_seqs=4, max_num_batched_tokens=64) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BS, True), max_num_seqs, max_num_batched_tokens, policy)


def step(sched: Scheduler) -> list[Sequence]:
    """One fake model step: every sampled sequence gets a token (charged as served); those at max_tokens finish.
    Returns the sequences that got a token."""
    batch = sched.schedule()
    sampled = [seq for seq, _, _ in sched.advance(batch)]
    for seq in sampled:
        seq.token_ids.append(7)
        sched.served_output(seq)
        if seq.num_output_tokens >= seq.params.max_tokens:
            sched.finish(seq, "length")
    sched.kv.check_invariants()
    return sampled


def test_counters_charge_weighted_tokens_over_the_tenant_weight_and_lift_never_lowers():
    counters = VirtualTokenCounters(input_weight=1.0, output_weight=2.0)
    counters.register("a", 1.0)
    counters.register("b", 4.0)
    counters.charge("a", num_input=10, num_output=5)
    counters.charge("b", num_input=10, num_output=5)
    assert counters.counters == {"a": 20.0, "b": 5.0}
    counters.register("c", 1.0)
    counters.lift("c", ["a", "b", "c"])  # back from idle: the smallest active counter, not its own 0
    assert counters.counters["c"] == 5.0
    counters.charge("c", num_output=50)
    counters.lift("c", ["a", "b"])  # ahead of everyone already: unchanged
    assert counters.counters["c"] == 105.0
    with pytest.raises(ValueError):
        counters.register("d", 0.0)


def test_the_fair_queue_serves_the_smallest_counter_then_priority_then_arrival():
    counters = VirtualTokenCounters(1.0, 2.0)
    queue = FairQueue(counters)
    a1, a2, a3 = make_seq("a1", 4, "a"), make_seq("a2", 4, "a", priority=-1), make_seq("a3", 4, "a")
    b1 = make_seq("b1", 4, "b")
    for seq in (a1, a2, a3, b1):
        counters.register(seq.request.tenant, 1.0)
        queue.push(seq)
    counters.charge("a", num_input=1)  # a is ahead: b's line goes first
    assert queue.peek() is b1 and queue.pop() is b1
    assert [queue.pop() for _ in range(2)] == [a2, a1]  # a's own line: priority -1 first, then arrival
    queue.push_front(a1)  # a preempted sequence goes back to the head of its own line
    assert queue.peek() is a1 and len(queue) == 2 and set(queue) == {a1, a3}
    queue.remove(a1)
    assert list(queue) == [a3] and queue.depth("a") == 1 and queue.tenants() == ["a"]
    queue.pop()
    assert queue.peek() is None and not queue


def test_fcfs_ignores_tenants_a_light_request_waits_behind_the_flood():
    sched = make_scheduler("fcfs")
    flood = [make_seq(f"a{i}", 4, "a") for i in range(8)]
    for seq in flood:
        sched.add(seq)
    step(sched)
    light = make_seq("b", 4, "b", max_tokens=3)
    sched.add(light)
    for _ in range(10):
        step(sched)
    assert light.status is SequenceStatus.WAITING and light.num_output_tokens == 0
    assert isinstance(sched.waiting, FcfsQueue) and sched.num_preemptions == 0


def test_fair_a_light_tenant_starts_within_a_step_of_arriving_under_a_flood():
    sched = make_scheduler("fair")
    flood = [make_seq(f"a{i}", 4, "a") for i in range(8)]
    for seq in flood:
        sched.add(seq)
    for _ in range(3):
        step(sched)
    assert [s.request.tenant for s in sched.running] == ["a"] * 4
    light = make_seq("b", 4, "b", max_tokens=3)
    sched.add(light)
    # lifted to a's counter on arrival (no banked credit), then a's running sequences run on
    assert sched.counters.counters["b"] == pytest.approx(sched.counters.counters["a"])
    got = step(sched)  # a tie takes the seat: b, below its share, starts in the first step after it arrived
    assert light in got and light.status is SequenceStatus.RUNNING
    assert sched.num_fair_preemptions == 1 and sched.seats_by_tenant() == {"a": 3, "b": 1}
    victim = flood[3]  # a's newest running sequence, back at the head of a's line with its tokens kept
    assert victim.status is SequenceStatus.WAITING and victim.num_output_tokens == 3 and sched.waiting.peek() is victim
    for _ in range(4):
        step(sched)
    assert light.is_finished and victim.status is SequenceStatus.RUNNING  # it got its seat back
    assert sched.num_fair_preemptions == 1  # a alone now: it never takes seats from itself


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_fair_a_light_prompt_starts_before_the_floods_long_prompt_chunks(policy):
    """The flood's long prompts are computed in chunks that would fill every step's budget; a tenant below its
    share of seats starts ahead of those chunks under "fair", in a step of its own prompt (and any decodes):
    the step is as short as that, not a full budget of the flood's chunks. Under "fcfs" it waits for them."""
    sched = make_scheduler(policy, max_num_seqs=8, max_num_batched_tokens=64)
    flood = [make_seq(f"a{i}", 200, "a") for i in range(2)]  # 200-token prompts, computed in 64-token chunks
    for seq in flood:
        sched.add(seq)
    step(sched)
    assert flood[0].num_computed_tokens == 64 and flood[1].status is SequenceStatus.WAITING
    light = make_seq("b", 8, "b", max_tokens=2)
    sched.add(light)
    step(sched)
    if policy == "fair":
        assert light.num_output_tokens == 1 and flood[0].num_computed_tokens == 64  # a step of b's 8 tokens alone
        step(sched)  # then the flood's chunks go on beside b's decode
        assert light.num_output_tokens == 2 and flood[0].num_computed_tokens == 64 + 63
    else:
        assert light.status is SequenceStatus.WAITING and flood[0].num_computed_tokens == 128
    assert flood[1].status is SequenceStatus.WAITING  # a tenant's own waiting prompts never pass its chunks
    assert sched.num_preemptions == 0


def test_fair_prompt_tokens_per_step_caps_prompt_work_only_while_tenants_share():
    """engine.fair_prompt_tokens_per_step: with one tenant a step takes the whole budget of prompt chunks; once a
    second tenant is active, at most the cap of prompt tokens beside the decodes."""
    sched = Scheduler(KVCacheManager(256, BS, True), 8, 64, "fair", fair_prompt_tokens=16)
    flood = [make_seq(f"a{i}", 200, "a") for i in range(2)]
    for seq in flood:
        sched.add(seq)
    step(sched)
    assert flood[0].num_computed_tokens == 64  # alone: the whole budget
    light = make_seq("b", 8, "b", max_tokens=50)
    sched.add(light)
    step(sched)  # b's 8-token prompt, in a step without a's chunks
    batch = sched.schedule()  # b decodes (1) and a's chunk is cut to the cap
    assert batch.num_tokens == 1 + 16 and batch.num_decodes == 1
    sched.advance(batch)


def _backlogged(weights: tuple[float, float], max_num_seqs: int, steps: int) -> tuple[dict[str, float], Scheduler]:
    """Two tenants, each with more requests waiting than `steps` can serve; weighted service after `steps`."""
    sched = make_scheduler("fair", max_num_seqs=max_num_seqs)
    ids = itertools.count()
    for tenant, weight in zip("ac", weights):
        for _ in range(100):
            sched.add(make_seq(f"{tenant}{next(ids)}", 8, tenant, weight, max_tokens=6))
    for _ in range(steps):
        step(sched)
    counters = sched.counters
    # weighted service: 1 x prompt tokens computed + 2 x tokens generated, per tenant
    return {t: counters.served_input[t] + 2 * counters.served_output[t] for t in "ac"}, sched


@pytest.mark.parametrize("weights,expected", [((1.0, 1.0), 1.0), ((1.0, 3.0), 3.0)])
def test_fair_two_backlogged_tenants_share_the_engine_by_their_weights(weights, expected):
    service, sched = _backlogged(weights, 4, 120)
    assert sched.waiting.depth("a") and sched.waiting.depth("c")  # both still backlogged at the end
    assert service["c"] / service["a"] == pytest.approx(expected, rel=0.15)
    assert sched.num_fair_preemptions <= 2  # a seat that went the wrong way is taken back, not traded


def test_fair_tenants_whose_seat_shares_are_not_whole_never_trade_seats_back_and_forth():
    service, sched = _backlogged((1.0, 1.0), 3, 120)  # 1.5 seats each
    assert sched.num_fair_preemptions == 0
    assert service["c"] / service["a"] == pytest.approx(1.0, rel=0.25)


def test_cached_prompt_tokens_are_not_charged():
    sched = make_scheduler("fair")
    prompt = list(range(500, 516))  # 4 full pages
    first = make_seq("x", prompt, "a", max_tokens=1)
    sched.add(first)
    step(sched)
    assert sched.counters.served_input["a"] == 16
    again = make_seq("y", prompt, "a", max_tokens=1)
    sched.add(again)
    step(sched)
    assert again.request.num_cached_tokens == 12 and sched.counters.served_input["a"] == 16 + 4


@pytest.mark.parametrize("policy,victim", [("fcfs", "b2"), ("fair", "a")])
def test_page_pressure_preempts_the_newest_or_under_fair_the_tenant_furthest_ahead(policy, victim):
    sched = Scheduler(KVCacheManager(3, BS, False), 8, 64, policy)
    # b1 fills its page (its next token needs another); a and b2 have room left in theirs; the pool is full
    seqs = {name: make_seq(name, 4 if name == "b1" else 3, name[0]) for name in ("b1", "a", "b2")}
    for seq in seqs.values():
        sched.add(seq)
    step(sched)
    assert [s.seq_id for s in sched.running] == ["b1", "a", "b2"]
    sched.counters.charge("a", num_output=100)  # a has been served far more than b
    step(sched)  # b1's next token needs a page: someone not yet scheduled this step must give one back
    assert [s.seq_id for s in sched.waiting] == [victim] and sched.num_preemptions == 1


def _run_flood(stories_dir, scheduling: str) -> tuple[dict[str, list[int]], int, int]:
    """A floods 8 requests into 4 seats; B's one request arrives at step 3. (outputs by request, the step B
    arrived, the step its first token came)."""
    from runtime import Engine

    engine = Engine.from_pretrained(stories_dir, num_blocks=128, max_num_seqs=4, scheduling=scheduling)
    greedy = SamplingParams(max_tokens=40, temperature=0)
    for i in range(8):
        engine.add_request(f"a{i}", f"Once upon a time, there was a little {'cat dog bird fish girl boy frog bear'.split()[i]}",
                           greedy, tenant="a")
    outputs: dict[str, list[int]] = {}
    arrived = first = None
    for step_no in itertools.count():
        if step_no == 3:
            engine.add_request("b", "Lily and Tom went to the park.", SamplingParams(max_tokens=5, temperature=0),
                               tenant="b")
            arrived = step_no
        for output in engine.step():
            if output.request_id == "b" and first is None and output.outputs[0].new_token_ids:
                first = step_no
            if output.finished:
                outputs[output.request_id] = output.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    engine.check_invariants()
    return outputs, arrived, first


def test_under_a_flood_fair_starts_the_light_tenant_within_three_steps_and_changes_no_output(stories_dir):
    fair, arrived, first_fair = _run_flood(stories_dir, "fair")
    fcfs, _, first_fcfs = _run_flood(stories_dir, "fcfs")
    assert first_fair - arrived <= 3 < first_fcfs - arrived  # fcfs: behind every waiting request of the flood
    assert fair == fcfs  # a preempted sequence is recomputed from its tokens: greedy outputs are the same


@pytest.mark.parametrize("scheduling", ["fcfs", "fair"])
def test_neither_policy_starts_a_cached_prompt_ahead_of_an_earlier_uncached_one(stories_dir, scheduling):
    """OptiLeak: a scheduler that favours cache hits tells a client, through the order of its answers, which of
    its prompts hit. One seat, so answers start in admission order. The attacker's probes alternate between an
    operator-shared prefix that is cached (hits) and other tokens (misses), among another tenant's requests:
    they start in the order sent, whatever hit."""
    from runtime import Engine

    engine = Engine.from_pretrained(stories_dir, num_blocks=256, max_num_seqs=1, scheduling=scheduling)
    shared = engine.request_builder.tokenize("Once upon a time, there was a little girl named Lily. She loved to play "
                                             "in the park with her dog and her friends every day after school.")
    shared_len = len(shared) // BS * BS
    greedy = SamplingParams(max_tokens=3, temperature=0)
    engine.generate([shared + [7]], greedy)  # the shared prefix is cached
    sent = []
    for i in range(8):
        hit = i % 2 == 0
        other = shared[:1] + [30 + (j + i) % 200 for j in range(len(shared) - 1)]
        engine.add_request(f"attacker-{i}", (shared if hit else other) + [20 + i], greedy, cache_salt=f"probe-{i}",
                           shared_prefix_len=shared_len if hit else 0, tenant="attacker")
        engine.add_request(f"other-{i}", [1] + [40 + i] * 24, greedy, tenant="other")
        sent.append(f"attacker-{i}")
    started: list[str] = []
    cached: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id.startswith("attacker") and output.request_id not in started:
                started.append(output.request_id)
                cached[output.request_id] = output.num_cached_tokens
    assert started == sent
    assert [cached[r] > 0 for r in sent] == [i % 2 == 0 for i in range(8)]  # the hits did hit


def test_the_fair_queue_breaks_a_counter_tie_for_the_tenant_further_below_its_share():
    counters = VirtualTokenCounters(1.0, 2.0)
    queue = FairQueue(counters)
    for tenant in "ab":
        counters.register(tenant, 1.0)
    counters.charge("a", num_input=50)
    counters.lift("b", ["a"])  # b arrives: level with a
    flood_head, light = make_seq("a0", 40, "a"), make_seq("b0", 4, "b")
    queue.push_front(flood_head)  # a preempted sequence: the head of a's line
    queue.push(light)
    assert queue.peek({"a": 0.9, "b": 0.1}) is light  # a holds 90% of its share, b 10%
    assert queue.peek({"a": 0.1, "b": 0.9}) is flood_head
    assert queue.pop({"a": 0.9, "b": 0.1}) is light


def test_fair_a_light_tenant_starts_in_the_step_it_arrives_when_the_floods_pages_bind_before_its_seats():
    """bench_fair_service.py's load in small: the flood's long prompts fill the pool with fewer sequences than
    its share of seats (7 of 8). The light tenant, level with the flood on arrival, starts in the step it
    arrives every time: the queue takes it before the flood's head, and the flood, holding more than its share
    of pages, gives one sequence back when too few pages are left after this step's decodes."""
    sched = Scheduler(KVCacheManager(160, BS, True), 16, 256, "fair", fair_prompt_tokens=64)
    for i in range(60):
        sched.add(make_seq(f"a{i}", 60, "a", max_tokens=24))
    late, num_arrivals = [], 0
    for step_no in range(2000):
        light = None
        if step_no % 7 == 3 and sched.waiting.depth("a"):  # while the flood is backlogged
            light = make_seq(f"b{step_no}", 8, "b", max_tokens=6)
            sched.add(light)
            num_arrivals += 1
        if light not in step(sched) and light is not None:
            late.append(step_no)
        if not sched.has_unfinished():
            break
    assert not sched.has_unfinished() and num_arrivals > 20
    assert late == []
    assert sched.num_fair_preemptions <= num_arrivals  # at most one of the flood's sequences per arrival


def test_the_policies_are_objects_registered_by_name_and_settings_and_the_cli_take_exactly_those_names():
    from config import ConfigError, load_settings
    from config.settings import SCHEDULING_NAMES
    from runtime.scheduling_policy import SCHEDULING_POLICIES
    from service.cli import build_parser

    assert {name: maker(VirtualTokenCounters(1.0, 2.0), 0).name for name, maker in SCHEDULING_POLICIES.items()} == \
        {"fcfs": "fcfs", "fair": "fair"}
    assert set(SCHEDULING_NAMES) == set(SCHEDULING_POLICIES)  # config names them without importing the runtime
    for name in SCHEDULING_POLICIES:
        assert make_scheduler(name).policy.name == name
        assert load_settings(environ={}, overrides={"engine": {"scheduling": name}}).engine.scheduling == name
        assert build_parser().parse_args(["serve", "--scheduling", name]).scheduling == name
    with pytest.raises(ValueError, match="'fcfs', 'fair'.*'lottery'"):
        make_scheduler("lottery")
    with pytest.raises(ConfigError, match="scheduling"):
        load_settings(environ={}, overrides={"engine": {"scheduling": "lottery"}})
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--scheduling", "lottery"])


def test_fair_a_light_tenant_a_few_tokens_ahead_on_counters_still_takes_pages_from_the_flood_holding_them():
    """Traced through the server: the light tenant, charged its prompt at once, sat a few tokens ahead of the
    flood, whose recomputed sequences are not charged; a smaller counter was then required of it, and it
    waited for steps while the flood, at its share of seats, held the whole pool. Shares decide: the flood
    keeps its share of pages."""
    sched = Scheduler(KVCacheManager(34, BS, True), 8, 256, "fair")
    sched.add(make_seq("b0", 3, "b", max_tokens=1000))
    for i in range(6):
        sched.add(make_seq(f"a{i}", 30, "a", max_tokens=1000))
    step(sched)
    assert sched.seats_by_tenant() == {"a": 4, "b": 1}  # a at its share of seats (4 of 8), with 32 of 34 pages
    assert sched.kv.pool.num_free_blocks == 1 and sched.waiting.depth("a") == 2
    counters = sched.counters.counters
    counters["b"] = counters["a"] + 6  # its running request's last tokens, charged while a's were recomputed
    light = make_seq("b1", 8, "b", max_tokens=4)
    sched.add(light)
    assert counters["b"] > counters["a"]  # a lift never lowers
    assert light in step(sched)
    assert sched.num_fair_preemptions == 1 and sched.seats_by_tenant() == {"a": 3, "b": 2}

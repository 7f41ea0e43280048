"""The scheduler alone: budgets, ordering, prefix hits, preemption and forks, with no model.

Each test builds `Request`/`Sequence` objects and a real `KVCacheManager`, then fakes a
model step with `step()`: schedule, advance (credit the computed tokens, fork n > 1), and
append a made-up sampled token to every sequence that sampled. Expectations are exact:
which sequences run, how many tokens each computes, in which order, on which pages.
Pages are handed out from the head of the free queue, so a fresh pool gives ids 0, 1, 2...
"""

import itertools

from runtime.detokenizer import IncrementalDetokenizer
from runtime.kv_cache_manager import KVCacheManager
from runtime.request import Request, Sequence, SequenceStatus
from runtime.sampling_params import SamplingParams
from runtime.batch import ScheduledBatch
from runtime.scheduler import Scheduler

BS = 4  # block size in every test
_token_base = itertools.count(1000, 1000)  # distinct prompts unless a test passes its own


def make_scheduler(num_blocks=64, max_num_seqs=16, max_num_batched_tokens=64, caching=True) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BS, caching), max_num_seqs, max_num_batched_tokens)


def make_seq(request_id: str, prompt: int | list[int], salt: bytes | None = None, **params) -> Sequence:
    token_ids = list(prompt) if isinstance(prompt, list) else [next(_token_base) + i for i in range(prompt)]
    request = Request(request_id, None, token_ids, SamplingParams(**params), salt)
    seq = Sequence(request, 0, list(token_ids), IncrementalDetokenizer(None, token_ids))
    request.sequences.append(seq)
    return seq


def add(sched: Scheduler, *seqs: Sequence) -> None:
    for seq in seqs:
        sched.add(seq)


def step(sched: Scheduler, token: int = 7) -> tuple[ScheduledBatch, list[tuple[Sequence, int]]]:
    """One fake model step; returns the batch and advance()'s (sequence, logits row) list."""
    batch = sched.schedule()
    sampled = [(seq, row) for seq, row, _ in sched.advance(batch)]
    for seq, _ in sampled:
        seq.token_ids.append(token)
    return batch, sampled


def plan(batch: ScheduledBatch) -> list[tuple[str, int]]:
    return [(entry.seq_id, entry.num_new_tokens) for entry in batch.entries]


def ids(seqs) -> list[str]:
    return [seq.seq_id for seq in seqs]


def test_long_prompt_is_chunked_to_the_token_budget():
    sched = make_scheduler(max_num_batched_tokens=8)
    a = make_seq("a", 20)
    add(sched, a)
    for chunk, computed, pages in [(8, 8, 2), (8, 16, 4)]:
        batch, sampled = step(sched)
        assert plan(batch) == [("a", chunk)] and batch.num_decodes == 0
        assert sampled == [] and a.num_computed_tokens == computed and a.num_tokens == 20
        assert sched.kv.block_ids(a) == list(range(pages))
    batch, sampled = step(sched)
    assert plan(batch) == [("a", 4)] and sampled == [(a, 0)]
    assert sched.kv.block_ids(a) == [0, 1, 2, 3, 4] and a.num_tokens == 21
    batch, sampled = step(sched)
    assert plan(batch) == [("a", 1)] and batch.num_decodes == 1 and sampled == [(a, 0)]
    sched.kv.check_invariants()


def test_token_budget_caps_the_total_across_sequences():
    sched = make_scheduler(max_num_batched_tokens=8)
    a, b, c = make_seq("a", 6), make_seq("b", 6), make_seq("c", 6)
    add(sched, a, b, c)
    expected = [[("a", 6), ("b", 2)], [("a", 1), ("b", 4), ("c", 3)], [("a", 1), ("b", 1), ("c", 3)]]
    for want in expected:
        batch, _ = step(sched)
        assert plan(batch) == want and sum(batch.num_new_tokens) <= 8
    assert ids(sched.running) == ["a", "b", "c"] and not sched.waiting
    sched.kv.check_invariants()


def test_decodes_go_first_then_chunks_then_waiting():
    sched = make_scheduler(max_num_batched_tokens=8)
    a, c, w = make_seq("a", 2), make_seq("c", 20), make_seq("w", 2)
    add(sched, a, c, w)
    batch, _ = step(sched)
    assert plan(batch) == [("a", 2), ("c", 6)] and batch.num_decodes == 0
    assert ids(sched.waiting) == ["w"]
    for _ in range(2):  # a decodes; c's chunk gets the 7 tokens left; w waits for budget
        batch, _ = step(sched)
        assert plan(batch) == [("a", 1), ("c", 7)] and batch.num_decodes == 1
        assert ids(sched.waiting) == ["w"]
    assert c.num_computed_tokens == 20
    batch, _ = step(sched)
    assert plan(batch) == [("a", 1), ("c", 1), ("w", 2)] and batch.num_decodes == 2
    sched.kv.check_invariants()


def test_decodes_go_before_an_older_prefill_chunk():
    # p's fork p#1 joins the running list after w, which is still prefilling.
    sched = make_scheduler(max_num_batched_tokens=8)
    p, w = make_seq("p", 2, n=2), make_seq("w", 20)
    add(sched, p, w)
    batch, sampled = step(sched)
    assert plan(batch) == [("p", 2), ("w", 6)]
    assert ids(sched.running) == ["p", "w", "p#1"] and [row for _, row in sampled] == [0, 0]
    batch, _ = step(sched)
    assert plan(batch) == [("p", 1), ("p#1", 1), ("w", 6)] and batch.num_decodes == 2
    sched.kv.check_invariants()


def test_max_num_seqs_caps_admissions():
    sched = make_scheduler(max_num_seqs=2)
    a, b, c = make_seq("a", 3), make_seq("b", 3), make_seq("c", 3)
    add(sched, a, b, c)
    batch, _ = step(sched)
    assert plan(batch) == [("a", 3), ("b", 3)] and ids(sched.waiting) == ["c"]
    batch, _ = step(sched)  # budget and pages to spare, but no seat
    assert plan(batch) == [("a", 1), ("b", 1)] and ids(sched.waiting) == ["c"]
    sched.finish(a, "length")
    batch, _ = step(sched)
    assert plan(batch) == [("b", 1), ("c", 3)] and ids(sched.running) == ["b", "c"]
    sched.kv.check_invariants()


def test_waiting_queue_is_first_come_first_served():
    sched = make_scheduler(num_blocks=4)
    a, big, small = make_seq("a", 8), make_seq("big", 12), make_seq("small", 2)
    add(sched, a, big, small)
    batch, _ = step(sched)  # big needs 3 pages, 2 are free; small would fit but waits behind it
    assert plan(batch) == [("a", 8)] and ids(sched.waiting) == ["big", "small"]
    sched.finish(a, "length")
    batch, _ = step(sched)
    assert plan(batch) == [("big", 12), ("small", 2)]
    sched.kv.check_invariants()


def test_prefix_hit_starts_after_cached_full_blocks_of_the_same_salt():
    sched = make_scheduler()
    prompt = list(range(10))  # two full blocks and two tokens
    a = make_seq("a", prompt, salt=b"t1")
    add(sched, a)
    step(sched)
    assert sched.kv.block_ids(a) == [0, 1, 2]
    b, c = make_seq("b", prompt, salt=b"t1"), make_seq("c", prompt, salt=b"t2")
    add(sched, b, c)
    batch, _ = step(sched)
    assert plan(batch) == [("a", 1), ("b", 2), ("c", 10)]
    assert sched.kv.block_ids(b) == [0, 1, 3] and sched.kv.block_ids(c) == [4, 5, 6]
    assert [sched.kv.pool.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]
    assert (b.request.num_cached_tokens, c.request.num_cached_tokens) == (8, 0)
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (30, 8)
    sched.kv.check_invariants()


def test_prefix_hit_leaves_the_last_token_to_compute():
    sched = make_scheduler()
    prompt = list(range(8))  # exactly two full blocks: the second is recomputed for its logits
    a, b = make_seq("a", prompt), make_seq("b", prompt)
    add(sched, a)
    step(sched)
    sched.finish(a, "length")  # its pages stay cached while free
    add(sched, b)
    batch, sampled = step(sched)
    assert plan(batch) == [("b", 4)] and sampled == [(b, 0)]
    assert sched.kv.block_ids(b) == [0, 2]  # block 0 revived from the free queue, then a new page
    assert b.request.num_cached_tokens == 4
    sched.kv.check_invariants()


def test_preemption_takes_the_newest_unscheduled_sequence():
    sched = make_scheduler(num_blocks=7)
    a, b, c, d, e = make_seq("a", 4), make_seq("b", 4), make_seq("c", 4), make_seq("d", 12), make_seq("e", 2)
    add(sched, a, b, c, d)
    step(sched)
    assert [sched.kv.block_ids(s) for s in (a, b, c, d)] == [[0], [1], [2], [3, 4, 5]]
    add(sched, e)
    # Each sequence now needs a new page and one is free: a takes it; b's need evicts d, not c.
    batch, _ = step(sched)
    assert plan(batch) == [("a", 1), ("b", 1), ("c", 1)]
    assert [sched.kv.block_ids(s) for s in (a, b, c)] == [[0, 6], [1, 5], [2, 4]]
    assert d.status is SequenceStatus.WAITING and d.num_computed_tokens == 0 and d.num_tokens == 13
    assert ids(sched.waiting) == ["d", "e"] and ids(sched.running) == ["a", "b", "c"]
    assert d.seq_id not in sched.kv.block_tables and sched.kv.pool.free_queue.block_ids() == [3]
    assert sched.num_preemptions == 1
    sched.kv.check_invariants()


def test_sequence_preempts_itself_when_the_others_are_scheduled():
    sched = make_scheduler(num_blocks=3)
    a, b = make_seq("a", 4), make_seq("b", 4)
    add(sched, a, b)
    step(sched)
    batch, _ = step(sched)  # a takes the last page; b's only candidate, a, already runs
    assert plan(batch) == [("a", 1)] and sched.kv.block_ids(a) == [0, 2]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert ids(sched.waiting) == ["b"] and ids(sched.running) == ["a"]
    assert b.seq_id not in sched.kv.block_tables and sched.kv.pool.free_queue.block_ids() == [1]
    assert sched.num_preemptions == 1
    sched.kv.check_invariants()


def test_no_admission_in_a_step_that_preempted():
    sched = make_scheduler(num_blocks=3, max_num_batched_tokens=4, caching=False)
    a, c = make_seq("a", 4), make_seq("c", 3)
    add(sched, a, c)
    expected = [[("a", 4)], [("a", 1), ("c", 3)], [("a", 1), ("c", 1)]]
    for want in expected:
        batch, _ = step(sched)
        assert plan(batch) == want
    assert sched.kv.pool.num_free_blocks == 0
    batch, _ = step(sched)  # c needs a second page: it preempts itself
    assert plan(batch) == [("a", 1)] and ids(sched.waiting) == ["c"] and sched.num_preemptions == 1
    assert sched.kv.can_allocate(c, 3)  # a 3-token chunk of c would fit, yet it was not admitted
    batch, _ = step(sched)
    assert plan(batch) == [("a", 1), ("c", 3)] and sched.kv.block_ids(c) == [2]
    assert c.status is SequenceStatus.RUNNING and c.num_computed_tokens == 3
    sched.kv.check_invariants()


def test_fork_after_prompt_shares_pages_and_logits_row():
    sched = make_scheduler(max_num_batched_tokens=4)
    f = make_seq("f", 6, n=3)
    request = f.request
    add(sched, f)
    batch, sampled = step(sched)
    assert plan(batch) == [("f", 4)] and sampled == [] and request.fork_pending
    assert ids(sched.running) == ["f"] and len(request.sequences) == 1
    batch, sampled = step(sched)
    assert plan(batch) == [("f", 2)] and not request.fork_pending
    assert [(s.seq_id, row) for s, row in sampled] == [("f", 0), ("f#1", 0), ("f#2", 0)]
    assert ids(request.sequences) == ids(sched.running) == ["f", "f#1", "f#2"]
    assert all(s.num_computed_tokens == 6 and s.num_tokens == 7 for s in request.sequences)
    assert [sched.kv.block_ids(s) for s in request.sequences] == [[0, 1]] * 3
    assert [sched.kv.pool.blocks[i].ref_count for i in (0, 1)] == [3, 3]
    batch, _ = step(sched)  # each fork writes into the shared partial page: copy on write
    assert plan(batch) == [("f", 1), ("f#1", 1), ("f#2", 1)] and batch.num_decodes == 3
    assert batch.blocks_to_copy == [(1, 2), (1, 3)]
    assert [sched.kv.block_ids(s) for s in request.sequences] == [[0, 2], [0, 3], [0, 1]]
    assert [sched.kv.pool.blocks[i].ref_count for i in range(4)] == [3, 1, 1, 1]
    sched.kv.check_invariants()


def test_pending_fork_counts_n_seats_at_admission():
    sched = make_scheduler(max_num_seqs=3)
    a, f = make_seq("a", 2), make_seq("f", 2, n=3)
    add(sched, a, f)
    batch, _ = step(sched)  # f is one sequence now but needs 3 seats: 1 + 3 > 3
    assert plan(batch) == [("a", 2)] and ids(sched.waiting) == ["f"]
    sched.finish(a, "length")
    batch, sampled = step(sched)
    assert plan(batch) == [("f", 2)] and ids(sched.running) == ["f", "f#1", "f#2"] and len(sampled) == 3
    sched.kv.check_invariants()


def test_finish_returns_pages_at_once():
    sched = make_scheduler(num_blocks=16)
    a, f, w = make_seq("a", 9), make_seq("f", 6, n=2), make_seq("w", 3)
    add(sched, a, f)
    for _ in range(3):
        step(sched)
    add(sched, w)
    assert sched.kv.pool.num_free_blocks < 16
    for seq in [*sched.running]:
        sched.finish(seq, "length")
        assert seq.seq_id not in sched.kv.block_tables and seq.finish_reason == "length"
    sched.finish(w, "abort")  # still waiting: it leaves the queue
    assert sched.kv.pool.num_free_blocks == 16 and not sched.has_unfinished()
    assert f.request.finished and a.status is SequenceStatus.FINISHED and not sched.kv.block_tables
    sched.kv.check_invariants()


def test_a_pending_fork_holds_its_seats_for_later_admissions_in_the_same_step():
    sched = make_scheduler(max_num_seqs=3)
    f = make_seq("f", 4, n=3)
    g = make_seq("g", 4)
    add(sched, f, g)
    batch, sampled = step(sched)
    assert plan(batch) == [("f", 4)]
    assert ids(sched.running) == ["f", "f#1", "f#2"] and ids(sched.waiting) == ["g"]
    for seq in list(sched.running):
        sched.finish(seq, "length")
    batch, _ = step(sched)
    assert plan(batch) == [("g", 4)]
    sched.kv.check_invariants()


def test_identical_prefixes_admitted_in_one_step_are_computed_once():
    prefix = [5, 6, 7, 8, 9, 10, 11, 12]  # two full pages
    sched = make_scheduler()
    a, b = make_seq("a", prefix + [1, 2]), make_seq("b", prefix + [3])
    add(sched, a, b)
    batch, _ = step(sched)
    # b hits the pages a computes in this same step and computes only its own token
    assert plan(batch) == [(a.seq_id, 10), (b.seq_id, 1)]
    assert sched.kv.block_ids(b)[:2] == sched.kv.block_ids(a)[:2]
    assert b.request.num_cached_tokens == 8 and a.request.num_cached_tokens == 0
    assert sched.prefix_cache_hits == 8


def test_a_prefix_hit_lands_on_pages_a_chunked_prefill_finishes_in_the_same_step():
    prefix = list(range(100, 116))  # four full pages
    sched = make_scheduler(max_num_batched_tokens=10)
    a = make_seq("a", prefix + [1])
    add(sched, a)
    step(sched)  # a's first chunk: 10 tokens, pages 0-1 full
    b = make_seq("b", prefix + [2])
    add(sched, b)
    batch, _ = step(sched)
    # a's last 7 tokens fill pages 2-3 in this step; b, admitted after it, hits all four pages
    assert plan(batch) == [(a.seq_id, 7), (b.seq_id, 1)]
    assert b.request.num_cached_tokens == 16
    assert sched.kv.block_ids(b)[:4] == sched.kv.block_ids(a)[:4]

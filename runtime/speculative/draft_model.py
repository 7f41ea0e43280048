r"""A draft model: a smaller checkpoint with the target's tokenizer runs ahead k tokens (vLLM's "draft_model").

It keeps its own paged KV cache: its own pages (`BlockPool`, no prefix caching), sized from its
own stated budget (SpeculativeConfig.draft_kv_cache_memory_bytes or draft_num_blocks), never
taken from the target's pool. Per sequence it remembers which tokens its pages hold:

    target tokens:  | prompt ............ outputs so far |
    draft KV:       | the same tokens ........... | d1 .. d(c-1) |     (written while drafting c tokens)

Before drafting, the draft's KV is cut back to the longest prefix that still agrees with the
sequence (its tokens only ever grow; drafts the target kept agree, the rest are rolled back by
lowering the count, and a page left wholly past the end goes back to the draft pool). Then one
forward over every drafting sequence's missing tokens (a whole prompt the first time, one to
k + 1 tokens after a verification) gives d1, and c - 1 batched one-token forwards give the rest.

The draft draws as the target would: greedy requests take its argmax (a one-hot q); sampled
ones draw from its tempered, top-k/p, min-p filtered distribution q, which goes with the drafts
(`Drafts.probs`) so that verification accepts with min(1, p/q) and stays exact.
A sequence whose pages do not fit in the draft pool drafts nothing this step (its output is the
same, only slower); its draft pages are freed with it.
"""

from __future__ import annotations

import time

import structlog
import torch

from runtime.block_pool import Block, BlockPool
from runtime.model.llama import LlamaForCausalLM
from runtime.model_runner import ModelRunner
from runtime.request import Sequence
from runtime.sampler import tempered_probs
from runtime.batch import ScheduledBatch, ScheduledSequence
from runtime.speculative.rejection import draw

log = structlog.get_logger(__name__)

COST_DECAY = 0.9  # weight of the past in the measured seconds per draft token


class _DraftState:
    """One sequence's pages in the draft's cache and the tokens their KV was computed for."""

    __slots__ = ("blocks", "block_ids", "token_ids", "num_confirmed")

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self.block_ids: list[int] = []  # the blocks' ids: the page table handed to the runner
        self.token_ids: list[int] = []  # KV in the draft's pages holds exactly these, position by position
        self.num_confirmed = 0  # the first num_confirmed of token_ids were the sequence's own (not drafts)


class DraftModelProposer:
    """Drafts with a second model over its own pages; batched over the step's drafting sequences."""

    sources = ("draft_model",)
    source = "draft_model"
    batched = True  # the Speculator plans how many drafts each sequence gets first, then calls propose_batch

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, kernel_backend: str, seed: int, relative_cost: float) -> None:
        self.runner = ModelRunner(model, num_blocks, block_size, device, dtype, kernel_backend)
        self.pool = BlockPool(num_blocks, enable_caching=False)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = min(model.config.max_position_embeddings, num_blocks * block_size)
        self.vocab_size = model.config.vocab_size
        self.generator = torch.Generator().manual_seed(seed ^ 0x5EED)  # draws of unseeded sampled requests
        self.states: dict[str, _DraftState] = {}
        # a seeded sequence's draft draws, kept until the sequence is forgotten (its pages may be dropped before)
        self.generators: dict[str, torch.Generator] = {}
        # a draft token's cost relative to a target step's fixed part (weights read), until measured
        self.relative_cost = relative_cost
        self.seconds_per_draft: float | None = None
        self.num_skipped_for_pages = 0  # sequence-steps that drafted nothing: the draft pool was full

    def draft_cost(self, target_fixed_seconds: float) -> float:
        """Seconds one more draft token costs: measured once drafting has run, before that the size ratio's guess."""
        if self.seconds_per_draft is None:
            return self.relative_cost * target_fixed_seconds
        return self.seconds_per_draft

    def propose(self, seq: Sequence, k: int) -> list[int]:
        return self.propose_batch([seq], [k])[0][0]

    def propose_batch(self, seqs: list[Sequence], counts: list[int]) -> list[tuple[list[int], torch.Tensor | None]]:
        """Up to counts[i] drafts for each of `seqs` (each one token from caught up in the target), each with
        the distribution it was drawn from: None for one-hot drafts (greedy), else float32 [num_drafts, vocab].
        """
        jobs: list[tuple[Sequence, _DraftState, int]] = []
        for seq, count in zip(seqs, counts):
            count = min(count, self.max_model_len - seq.num_tokens + 1)
            if count <= 0:
                continue
            state = self._caught_up_state(seq, count)
            if state is not None:
                jobs.append((seq, state, count))
        drafts: dict[str, list[int]] = {seq.seq_id: [] for seq in seqs}
        if not jobs:
            return [(drafts[seq.seq_id], None) for seq in seqs]
        probs: dict[str, list[torch.Tensor]] = {seq.seq_id: [] for seq, _, _ in jobs}
        # one forward over what each draft cache lacks, ending with the sequence's last token: d1
        entries = []
        for seq, state, _ in jobs:
            start = len(state.token_ids)
            chunk = seq.token_ids[start:]
            state.token_ids += chunk
            state.num_confirmed = len(state.token_ids)
            entries.append(ScheduledSequence(seq.seq_id, chunk, start, list(state.block_ids), 0, 1))
        self._draw(ScheduledBatch(entries=entries, num_decodes=0), jobs, drafts, probs)
        # then one token at a time: d(i) in, d(i + 1) out. Their time is what a draft costs (the forward above
        # also catches up a prompt the first time, which no later draft pays again)
        started = time.perf_counter()
        num_timed = 0
        for i in range(1, max(count for _, _, count in jobs)):
            running = [(seq, state, count) for seq, state, count in jobs if count > i]
            entries = []
            for seq, state, _ in running:
                token = drafts[seq.seq_id][-1]
                entries.append(ScheduledSequence(seq.seq_id, [token], len(state.token_ids), list(state.block_ids),
                                                 0, 1))
                state.token_ids.append(token)
            self._draw(ScheduledBatch(entries=entries, num_decodes=len(entries)), running, drafts, probs)
            num_timed += len(running)
        if num_timed:
            seconds = (time.perf_counter() - started) / num_timed
            self.seconds_per_draft = seconds if self.seconds_per_draft is None else (
                COST_DECAY * self.seconds_per_draft + (1.0 - COST_DECAY) * seconds)
        stacked = {seq_id: torch.stack(rows) for seq_id, rows in probs.items() if rows}  # [num_drafts, vocab]
        return [(drafts[seq.seq_id], stacked.get(seq.seq_id)) for seq in seqs]

    def _caught_up_state(self, seq: Sequence, count: int) -> _DraftState | None:
        """The sequence's draft state cut back to what agrees with its tokens, with pages for `count` drafts."""
        state = self.states.get(seq.seq_id)
        if state is None:
            state = self.states[seq.seq_id] = _DraftState()
        common = state.num_confirmed
        tokens = seq.token_ids
        limit = min(len(state.token_ids), len(tokens))
        while common < limit and state.token_ids[common] == tokens[common]:
            common += 1
        common = min(common, len(tokens) - 1)  # the last token goes in again: its row gives d1
        del state.token_ids[common:]
        state.num_confirmed = common
        # KV for every token of the sequence, then for d1 .. d(count - 1)
        needed = -(-(len(tokens) + count - 1) // self.block_size)
        missing = needed - len(state.blocks)
        if missing > self.pool.num_free_blocks:
            if not self.num_skipped_for_pages:
                log.warning("draft pool full: a sequence drafts nothing this step (speculative_config's "
                            "draft_kv_cache_memory_bytes or draft_num_blocks sets its size)", num_blocks=self.num_blocks)
            self.num_skipped_for_pages += 1
            self._release(seq.seq_id)
            return None
        if missing > 0:
            state.blocks += self.pool.get_new_blocks(missing)
        self._trim(state, needed)
        state.block_ids = [b.block_id for b in state.blocks]  # once per step, not per draft forward
        return state

    def _trim(self, state: _DraftState, num_blocks: int) -> None:
        """Pages past the first `num_blocks` go back to the pool."""
        if len(state.blocks) > num_blocks:
            self.pool.free_blocks(reversed(state.blocks[num_blocks:]))
            del state.blocks[num_blocks:]
            del state.block_ids[num_blocks:]

    def _draw(self, batch: ScheduledBatch, jobs: list[tuple[Sequence, _DraftState, int]],
              drafts: dict[str, list[int]], probs: dict[str, list[torch.Tensor]]) -> None:
        """Run the batch (one logits row per job, in order) and draw each job's next draft."""
        logits = self.runner.execute(batch).float().cpu()  # [len(jobs), vocab]
        greedy = [seq.params.is_greedy for seq, _, _ in jobs]
        argmax = logits.argmax(dim=-1).tolist() if any(greedy) else []
        for row, (seq, state, _) in enumerate(jobs):
            if greedy[row]:
                drafts[seq.seq_id].append(argmax[row])
                continue
            q = tempered_probs(logits[row], seq.params)  # [vocab]
            drafts[seq.seq_id].append(draw(q, self._generator_for(seq)))
            probs[seq.seq_id].append(q)

    def _generator_for(self, seq: Sequence) -> torch.Generator:
        """A seeded request's draft draws come from its own generator, made once and kept until the sequence
        is forgotten (its pages may be dropped before), so a seed reproduces its drafts too; else the proposer's."""
        if seq.params.seed is None:
            return self.generator
        generator = self.generators.get(seq.seq_id)
        if generator is None:
            seed = (seq.params.seed * 1_000_003 + seq.index + 0x0D7AF7) & 0xFFFF_FFFF_FFFF
            generator = self.generators[seq.seq_id] = torch.Generator().manual_seed(seed)
        return generator

    def _release(self, seq_id: str) -> None:
        state = self.states.pop(seq_id, None)
        if state is not None:
            self._trim(state, 0)

    def forget(self, seq: Sequence) -> None:
        """A finished sequence's draft pages go back to the draft pool."""
        self._release(seq.seq_id)
        self.generators.pop(seq.seq_id, None)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.pool.num_free_blocks

    def check_invariants(self, live_seq_ids: set[str]) -> None:
        """Raise unless every used draft page belongs to exactly one live sequence's state."""
        self.pool.check_invariants()
        held = [b.block_id for seq_id, state in self.states.items() for b in state.blocks]
        stale = (set(self.states) | set(self.generators)) - live_seq_ids
        if stale:
            raise RuntimeError(f"draft pages held for sequences that ended: {sorted(stale)}")
        if len(held) != len(set(held)) or len(held) != self.num_used_blocks:
            raise RuntimeError(f"draft pool: {len(held)} pages in tables, {self.num_used_blocks} in use")
        for state in self.states.values():
            if len(state.token_ids) > len(state.blocks) * self.block_size:
                raise RuntimeError("a draft state holds more tokens than its pages")

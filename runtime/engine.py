"""The engine: requests in, one batched step at a time, outputs back.

    step():  schedule (make room, drafts, placement) -> run the model through the page tables
             -> sample or verify ({seq_id: SampledTokens}) -> update (append, stop checks, pages)

Single-threaded: whoever drives it (generate(), or the service's engine thread) owns every
page and tensor it holds.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import structlog
import torch
from tqdm import tqdm

import kernels
from config import ConfigError, EngineSettings, load_engine_settings, parse_speculative_config
from runtime.batch import Drafts, SampledTokens, ScheduledBatch
from runtime.detokenizer import IncrementalDetokenizer
from runtime.engine_snapshot import engine_stats, page_map
from runtime.dtypes import resolve_dtype
from runtime.kv_cache_manager import KVCacheManager
from runtime.kv_events import KVEvent
from runtime.model.checkpoint import load_checkpoint
from runtime.model.config import ModelConfig
from runtime.model.demo import DEMO_MODEL_NAME, build_demo_model
from runtime.model.llama import LlamaForCausalLM
from runtime.model_runner import ModelRunner
from runtime.outputs import CompletionOutput, RequestOutput, TokenLogprob
from runtime.request import Request, Sequence, SequenceStatus
from runtime.request_builder import RequestBuilder, RequestLimits
from runtime.sampler import Sampler
from runtime.sampling_params import InvalidRequestError, SamplingParams
from runtime.scheduler import Scheduler
from runtime.stop_rules import check_stop
from runtime.timeline import RequestTimeline, StepShape
from runtime.speculative.draft_model import DraftModelProposer
from runtime.speculative.speculator import Speculator
from runtime.speculative.verification import verify_drafts
from runtime.tokenizer import ByteTokenizer

PIN_TENANT = "(pins)"  # fair scheduling's party for pin prefills: the operator's, no tenant's
log = structlog.get_logger(__name__)



class Engine:
    """A paged-KV inference engine for one Llama-family model (vLLM's LLM/LLMEngine shape).

    Requests are validated once, by `request_builder` (a RequestBuilder: it reads only what never
    changes after start, so the service calls it on its event loop), then queued by `add`.
    """

    def __init__(self, model: LlamaForCausalLM, tokenizer, settings: EngineSettings, model_name: str) -> None:
        self.model_config: ModelConfig = model.config
        self.settings = settings
        self.model_name = model_name
        config = self.model_config
        self.block_size = settings.block_size
        device = torch.device(settings.device)
        self.dtype = resolve_dtype(settings.dtype, device)
        self.num_blocks = settings.num_blocks or self._blocks_for_budget(settings.kv_cache_memory_bytes)
        # pins may hold up to a quarter of the pool; one request must always fit in the rest
        self.pinned_block_budget = min(settings.pinned_block_budget, self.num_blocks // 4)
        self.num_schedulable_blocks = self.num_blocks - self.pinned_block_budget
        self.max_model_len = min(settings.max_model_len or config.max_position_embeddings,
                                 config.max_position_embeddings, self.num_schedulable_blocks * self.block_size)
        model.limit_positions(self.num_blocks * self.block_size)  # no position past the KV slots is ever computed
        eos = set(config.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(tokenizer.eos_token_id)
        self.tokenizer = tokenizer
        self.limits = RequestLimits(config.vocab_size, self.block_size, self.max_model_len, settings.max_num_seqs,
                                    self.num_schedulable_blocks, tuple(sorted(eos)))
        self.request_builder = RequestBuilder(tokenizer, self.limits)
        self.eos_token_ids = frozenset(self.limits.eos_token_ids)
        self.kv = KVCacheManager(self.num_blocks, self.block_size, settings.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, settings.max_num_seqs, settings.max_num_batched_tokens,
                                   settings.scheduling, settings.fair_input_weight, settings.fair_output_weight,
                                   settings.fair_prompt_tokens_per_step)
        backend = kernels.resolve_backend(settings.kernel_backend, device)
        self.runner = ModelRunner(model, self.num_blocks, self.block_size, device, self.dtype, backend)
        self.sampler = Sampler(settings.seed)
        self.speculator = Speculator(settings.speculative_config, self._draft_proposer(settings, device, backend))
        self.num_steps = 0  # steps run
        self.trace_requests = False  # stamp each request's RequestTimeline (runtime/timeline.py)
        self.requests: dict[str, Request] = {}
        self._ended: list[Request] = []  # ended outside a step (aborted; max_tokens=0): the next step reports them
        self._pending_pins: dict[str, tuple[str, int]] = {}  # pin id -> (prefill request id, pages)
        self._ids = itertools.count()
        log.info(
            "engine ready", model=model_name, num_blocks=self.num_blocks, block_size=self.block_size,
            max_model_len=self.max_model_len, device=settings.device, dtype=str(self.dtype).removeprefix("torch."),
        )

    def _draft_proposer(self, settings: EngineSettings, device: torch.device, backend: str) -> DraftModelProposer | None:
        """The draft model and its own pages, for method "draft_model" (else None).

        Raises ConfigError if the draft's vocabulary is not the target's (it must share the tokenizer).
        """
        config = settings.speculative_config
        if config is None or config.method != "draft_model":
            return None
        draft, _, name = load_checkpoint(config.model, device, self.dtype, settings.quantization, with_tokenizer=False)
        if draft.config.vocab_size != self.model_config.vocab_size:
            raise ConfigError(f"draft model {name!r} has a vocabulary of {draft.config.vocab_size}, the target "
                              f"{self.model_config.vocab_size}: a draft model must share the target's tokenizer")
        bytes_per_block = self.block_size * draft.config.kv_bytes_per_token(self.dtype.itemsize)
        num_blocks = config.draft_num_blocks or max(1, config.draft_kv_cache_memory_bytes // bytes_per_block)
        target_bytes = self.runner.model.weight_bytes()
        proposer = DraftModelProposer(draft, num_blocks, self.block_size, device, self.dtype, backend, settings.seed,
                                      draft.weight_bytes() / max(target_bytes, 1))
        log.info("draft model ready", model=name, layers=draft.config.num_layers, num_blocks=num_blocks,
                 kv_cache_bytes=num_blocks * bytes_per_block, relative_cost=round(proposer.relative_cost, 3))
        return proposer

    def _blocks_for_budget(self, budget_bytes: int) -> int:
        bytes_per_block = self.block_size * self.model_config.kv_bytes_per_token(self.dtype.itemsize)
        return max(1, budget_bytes // bytes_per_block)

    @classmethod
    def from_pretrained(cls, model: str | Path, *, show_progress: bool = False, settings_file=None, **overrides) -> Engine:
        """Load a Hugging Face checkpoint folder, a GGUF file, or "demo" for the built-in random-weight model.

        Keyword overrides are EngineSettings fields: device, dtype, quantization, block_size,
        num_blocks, kv_cache_memory_bytes, max_num_seqs, max_num_batched_tokens,
        enable_prefix_caching, max_model_len, seed, kernel_backend, speculative_config (vLLM's keys,
        as a dict or its JSON).
        """
        if "speculative_config" in overrides:  # JSON or a dict, checked (and named if wrong) here
            overrides["speculative_config"] = parse_speculative_config(overrides["speculative_config"])
        settings = load_engine_settings(settings_file, **overrides)
        device = torch.device(settings.device)
        dtype = resolve_dtype(settings.dtype, device)
        if str(model) == "demo":
            log.warning("loading the demo model: RANDOM weights, its text is noise", model=DEMO_MODEL_NAME)
            return cls(build_demo_model(device, dtype), ByteTokenizer(), settings, DEMO_MODEL_NAME)
        net, tokenizer, name = load_checkpoint(model, device, dtype, settings.quantization, show_progress)
        return cls(net, tokenizer, settings, name)

    # --- requests: validated once (request_builder.prepare_request), then queued (add) ---

    def add(self, request: Request) -> None:
        """Queue a request made by `request_builder.prepare_request`; it joins the batch at the next step with room.

        Raises InvalidRequestError (param "request_id") if the id is in use.
        """
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use", param="request_id")
        params = request.params
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, params.stop, params.include_stop_str_in_output,
            params.skip_special_tokens,
        )
        seq = Sequence(request, 0, list(request.prompt_token_ids), detokenizer)
        request.sequences.append(seq)
        self.requests[request.request_id] = request
        if self.trace_requests:
            request.timeline = RequestTimeline(queued_at=time.monotonic(), queued_step=self.num_steps)
        if params.max_tokens == 0:  # nothing to generate: done before it runs, reported by the next step
            request.sequences += [seq.fork(i, detokenizer.copy()) for i in range(1, params.n)]
            for sample in request.sequences:
                sample.status, sample.finish_reason = SequenceStatus.FINISHED, "length"
            request.fork_pending = False
            request.num_cached_tokens = 0
            self._ended.append(request)
            return
        self.scheduler.add(seq)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        cache_salt: str | bytes | None = None,
        shared_prefix_len: int = 0,
        prediction: str | list[int] | None = None,
        tenant: str = "default",
        tenant_weight: float = 1.0,
        priority: int = 0,
    ) -> None:
        """`add(request_builder.prepare_request(...))`: validate and queue, for callers that drive the engine."""
        self.add(self.request_builder.prepare_request(request_id, prompt, params, cache_salt, shared_prefix_len,
                                                      prediction=prediction, tenant=tenant, tenant_weight=tenant_weight,
                                                      priority=priority))

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now; its pages are free at once and the next step reports it ("abort")."""
        request = self.requests.get(request_id)
        if request is None or request.aborted or request.finished:  # already ended, waiting to be reported
            return False
        request.aborted = True
        for seq in request.sequences:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        self._ended.append(request)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def unfinished_request_ids(self) -> list[str]:
        """Ids of every request not yet reported finished (pin prefills included)."""
        return list(self.requests)

    # --- pinned prefixes and KV events ----------------------------------------------------

    def pin_prefix(self, pin_id: str, prompt: str | list[int], cache_salt: str | bytes | None = None,
                   shared_prefix_len: int = 0) -> str:
        """Prefill `prompt` and keep its full pages (never evicted) until unpin_prefix(pin_id).

        Returns the prefill's request id (its output finishes when the pages are pinned).
        Raises InvalidRequestError (code "pin_budget_exceeded") if pinned and pending pages
        would exceed the pin budget (settings.pinned_block_budget, at most a quarter of the pool).
        """
        request = self.request_builder.prepare_request(f"pin:{pin_id}:{next(self._ids)}", prompt,
                                                       SamplingParams(max_tokens=1, temperature=0), cache_salt,
                                                       shared_prefix_len, pin_id, prompt_param="text", tenant=PIN_TENANT)
        num_pages = len(request.prompt_token_ids) // self.block_size
        held = sum(len(b) for pid, b in self.kv.pinned.items() if pid != pin_id)
        held += sum(pages for pid, (_, pages) in self._pending_pins.items() if pid != pin_id)
        if held + num_pages > self.pinned_block_budget:
            raise InvalidRequestError(
                f"pinning {num_pages} pages would exceed the budget of {self.pinned_block_budget} ({held} held)",
                param="text", code="pin_budget_exceeded",
            )
        self.unpin_prefix(pin_id)
        self.add(request)
        self._pending_pins[pin_id] = (request.request_id, num_pages)
        return request.request_id

    def unpin_prefix(self, pin_id: str) -> bool:
        """Release a pinned prefix's pages back to the cache (evictable again); stops a pending prefill."""
        pending = self._pending_pins.pop(pin_id, None)
        if pending is not None:
            self.abort_request(pending[0])
        return self.kv.unpin(pin_id) or pending is not None

    def record_kv_events(self) -> None:
        """Start recording prefix-cache events (blocks stored and removed) for take_kv_events()."""
        if self.kv.pool.kv_events is None:
            self.kv.pool.kv_events = []

    def take_kv_events(self) -> list[KVEvent]:
        """Blocks stored in and removed from the prefix cache since the last call, in order."""
        events = self.kv.pool.kv_events
        if not events:
            return []
        self.kv.pool.kv_events = []
        return events

    # --- the step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; return every request that got new tokens or finished."""
        step_started = time.monotonic()
        outputs = [self._make_output(request) for request in self._take_ended()]
        batch = self.scheduler.schedule(self._propose)
        if not batch.is_empty:
            traced = self._traced_requests(batch) if self.trace_requests else None
            started = time.perf_counter()
            logits = self.runner.execute(batch)  # [num_sample_rows, vocab]
            to_sample = self.scheduler.advance(batch)  # computed tokens credited; n > 1 forks here
            outputs += self._update(batch, to_sample, self._sample(batch, logits, to_sample))
            self.speculator.observe_step(batch.num_tokens, time.perf_counter() - started)
            if traced:
                self._stamp_timelines(traced, batch, step_started)
            self.num_steps += 1
        elif self.scheduler.waiting and not self.scheduler.running:
            raise RuntimeError("scheduler made no progress with requests waiting and none running")
        if not self.scheduler.has_unfinished():
            self.check_invariants()  # idle: every page must be accounted for
        return outputs

    def _propose(self, running: list[Sequence]) -> dict[str, Drafts]:
        """The running sequences' drafts for this step (the scheduler asks once it has made room)."""
        return self.speculator.propose(running, self.scheduler.num_pending_prompt_tokens, self.max_model_len)

    def _traced_requests(self, batch: ScheduledBatch) -> list[Request]:
        """This step's requests still missing a first step or a first token (their timelines are stamped after it)."""
        found = {}
        scheduled = {entry.seq_id for entry in batch.entries}
        for seq in self.scheduler.running:
            if seq.seq_id not in scheduled:
                continue
            timeline = seq.request.timeline
            if timeline is not None and timeline.first_token is None:
                found[seq.request.request_id] = seq.request
        return list(found.values())

    def _stamp_timelines(self, requests: list[Request], batch, started_at: float) -> None:
        shape = StepShape(self.num_steps, started_at, time.monotonic() - started_at, len(batch.entries),
                          batch.num_tokens, batch.num_decodes, len(self.scheduler.waiting), len(self.scheduler.running))
        for request in requests:
            timeline = request.timeline
            if timeline.first_scheduled is None:
                timeline.first_scheduled = shape
            if any(seq.num_output_tokens for seq in request.sequences):
                timeline.first_token = shape

    def _sample(self, batch: ScheduledBatch, logits: torch.Tensor,  # logits: [num_sample_rows, vocab]
                to_sample: list[tuple[Sequence, int, list[int]]]) -> dict[str, SampledTokens]:
        """The step's new tokens by sequence id: one per plain row (all such rows at once), a run per verification.
        Reads the sequences' sampling state; changes none of it (that is `_update`'s)."""
        sampled: dict[str, SampledTokens] = {}
        plain = [(seq, row) for seq, row, drafts in to_sample if not drafts]
        if plain:
            rows = [row for _, row in plain]
            plain_logits = logits
            if rows != list(range(logits.shape[0])):  # else every row samples, in order: no copy of the logits
                plain_logits = logits[torch.tensor(rows, dtype=torch.int64, device=logits.device)]
            token_ids, logprobs = self.sampler(plain_logits, [seq for seq, _ in plain])
            for (seq, _), token_id, token_logprobs in zip(plain, token_ids, logprobs):
                sampled[seq.seq_id] = SampledTokens([token_id], [token_logprobs])
        for seq, row, drafts in to_sample:
            if drafts:
                sampled[seq.seq_id] = verify_drafts(self.sampler, logits[row : row + len(drafts) + 1], seq,
                                                    batch.drafts[seq.seq_id], self.eos_token_ids)
        return sampled

    def _update(self, batch: ScheduledBatch, to_sample: list[tuple[Sequence, int, list[int]]],
                sampled: dict[str, SampledTokens]) -> list[RequestOutput]:
        """Apply the step's tokens: each appended with its stop checks (a stop inside a verified run ends it there),
        kept drafts' KV credited, the drafts' outcome recorded and rejected drafts' pages given back."""
        touched: dict[str, Request] = {}
        for seq, _, drafts in to_sample:
            result = sampled[seq.seq_id]
            touched[seq.request.request_id] = seq.request
            if not drafts:  # one token: most rows, kept to the fewest steps
                self._append_token(seq, result.token_ids[0], result.logprobs[0])
                continue
            num_kept = 0  # kept drafts among the tokens appended
            for i, token_id in enumerate(result.token_ids):
                if i < result.num_accepted_drafts:
                    num_kept += 1
                    self.scheduler.accept_draft(seq)
                self._append_token(seq, token_id, result.logprobs[i])
                if seq.is_finished:
                    break
            self.speculator.record(seq, batch.drafts[seq.seq_id].source, len(drafts), num_kept)
            self.scheduler.release_rejected(seq)
        return [self._make_output(request) for request in touched.values()]

    def _take_ended(self) -> list[Request]:
        """Requests that ended outside a step (aborted, or nothing to generate), to report now."""
        ended, self._ended = self._ended, []
        return ended

    def _append_token(self, seq: Sequence, token_id: int, token_logprobs: dict[int, float] | None) -> None:
        seq.append_token(token_id)
        self.scheduler.served_output(seq)
        if token_logprobs is not None:
            seq.logprobs.append(token_logprobs)
            seq.cumulative_logprob += token_logprobs[token_id]
        reason, stop_reason = check_stop(seq, token_id, self.eos_token_ids, self.max_model_len)
        if reason is not None:
            seq.stop_reason = stop_reason
            self.scheduler.finish(seq, reason)

    def _make_output(self, request: Request) -> RequestOutput:
        """This step's news for a request (deltas); its final output also carries the whole."""
        completions = []
        wants_logprobs = request.params.logprobs is not None
        final = request.finished
        for seq in request.sequences:
            new_ids = seq.token_ids[seq.num_prompt_tokens + seq.num_emitted_tokens :]
            seq.num_emitted_tokens += len(new_ids)
            detokenizer = seq.detokenizer
            new_text = detokenizer.take_new_text(seq.is_finished)
            new_logprobs = None
            if wants_logprobs:
                first = seq.num_prompt_tokens
                new_logprobs = [TokenLogprob(seq.token_ids[first + i], text, seq.logprobs[i])
                                for i, text in detokenizer.take_token_texts(seq.is_finished)]
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=detokenizer.text if final else "",
                    token_ids=seq.output_token_ids if final else [],
                    new_text=new_text,
                    new_token_ids=new_ids,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    logprobs=list(seq.logprobs) if final and wants_logprobs else None,
                    new_logprobs=new_logprobs,
                    cumulative_logprob=seq.cumulative_logprob if wants_logprobs else None,
                )
            )
        if final:
            for seq in request.sequences:
                self.speculator.forget(seq)
            self.requests.pop(request.request_id, None)
            pin = self._pending_pins.get(request.pin_id) if request.pin_id is not None else None
            if pin is not None and pin[0] == request.request_id:
                del self._pending_pins[request.pin_id]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            num_cached_tokens=request.num_cached_tokens or 0,
            finished=final,
            num_accepted_prediction_tokens=request.num_accepted_prediction_tokens,
            num_cache_written_tokens=request.num_cache_written_tokens,
        )

    # --- offline convenience ------------------------------------------------------------

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        cache_salt: str | bytes | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run prompts to completion together; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidRequestError("one SamplingParams per prompt, or one for all", param="params")
        request_ids = [f"generate-{next(self._ids)}" for _ in prompts]
        for request_id, prompt, p in zip(request_ids, prompts, params_list):
            self.add_request(request_id, prompt, p, cache_salt)
        finals: dict[str, RequestOutput] = {}
        with tqdm(total=len(prompts), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while len(finals) < len(request_ids):
                for output in self.step():
                    if output.finished and output.request_id in request_ids:
                        finals[output.request_id] = output
                        bar.update(1)
        return [finals[request_id] for request_id in request_ids]

    # --- introspection ------------------------------------------------------------------

    def stats(self) -> dict:
        """Page and queue counters (the names the metrics and the dashboard use: runtime/engine_snapshot.py)."""
        return engine_stats(self)

    def page_map(self) -> dict:
        """A snapshot of every page and every live sequence's page table (the dashboard's picture)."""
        return page_map(self)

    def check_invariants(self) -> None:
        """Raise if page bookkeeping is inconsistent (see BlockPool.check_invariants), the draft model's too."""
        self.kv.check_invariants()
        draft = self.speculator.proposer
        if isinstance(draft, DraftModelProposer):
            draft.check_invariants({seq.seq_id for request in self.requests.values() for seq in request.sequences})

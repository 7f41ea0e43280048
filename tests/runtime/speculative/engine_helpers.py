"""Engines with and without speculation, test proposers, and the page invariants checked after every step."""

from __future__ import annotations

import random

from runtime import Engine, SamplingParams
from runtime.request import Sequence
from runtime.speculative.proposers import Proposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


class ScriptProposer:
    """Drafts from a known continuation per prompt (the oracle), optionally each token made wrong."""

    sources = ("script",)
    source = "script"

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], wrong: bool = False, vocab: int = 0) -> None:
        self.continuations = continuations
        self.wrong = wrong
        self.vocab = vocab

    def propose(self, seq: Sequence, k: int) -> list[int]:
        script = self.continuations[tuple(seq.token_ids[: seq.num_prompt_tokens])]
        drafts = script[seq.num_output_tokens : seq.num_output_tokens + k]
        return [(t + 1) % self.vocab for t in drafts] if self.wrong else drafts

    def forget(self, seq: Sequence) -> None:
        pass


class RandomProposer:
    """Drafts uniform random tokens from its own generator (a one-hot q given that generator: still exact)."""

    sources = ("random",)
    source = "random"

    def __init__(self, tokens: list[int], seed: int = 0) -> None:
        self.tokens = tokens
        self.random = random.Random(seed)

    def propose(self, seq: Sequence, k: int) -> list[int]:
        return [self.random.choice(self.tokens) for _ in range(k)]

    def forget(self, seq: Sequence) -> None:
        pass


class GreedyModelProposer:
    """Drafts the greedy continuation of a transformers model (a deterministic draft model, for tests)."""

    sources = ("greedymodel",)
    source = "greedymodel"

    def __init__(self, model_dir) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def propose(self, seq: Sequence, k: int) -> list[int]:
        with self.torch.inference_mode():
            out = self.model.generate(self.torch.tensor([seq.token_ids]), max_new_tokens=k, do_sample=False,
                                      min_new_tokens=k, pad_token_id=0)
        return out[0, seq.num_tokens :].tolist()

    def forget(self, seq: Sequence) -> None:
        pass


def engine(model, speculative: dict | None = None, proposer: Proposer | None = None, **settings) -> Engine:
    """An engine on `model`; with `proposer`, that proposer drafts (k from `speculative`, default 4)."""
    if proposer is not None and speculative is None:
        speculative = dict(NGRAM)
    built = Engine.from_pretrained(model, speculative_config=speculative, **settings)
    if proposer is not None:
        built.speculator.proposer = proposer
    return built


def check_pages(engine: Engine) -> None:
    """The pool's invariants, and: a hashed page of a live sequence holds only its computed, own tokens."""
    engine.check_invariants()
    bs = engine.block_size
    for seq in engine.scheduler.running:
        for i, block in enumerate(engine.kv.block_tables.get(seq.seq_id, [])):
            if block.block_hash is not None:
                if (i + 1) * bs > seq.num_computed_tokens:
                    raise AssertionError(f"{seq} page {i} is hashed past its computed tokens")
                if block.block_hash != seq.block_hashes[i]:
                    raise AssertionError(f"{seq} page {i} is hashed with tokens that are not its own")


def run(engine: Engine, prompts: list, params: SamplingParams | list[SamplingParams], **add) -> list:
    """generate(), stepping by hand so the page invariants are checked after every step; outputs in prompt order."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    ids = [f"t{i}-{id(prompts)}" for i in range(len(prompts))]
    for request_id, prompt, p in zip(ids, prompts, params_list):
        engine.add_request(request_id, prompt, p, **add)
    finals = {}
    while len(finals) < len(ids):
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        check_pages(engine)
    if engine.kv.pool.num_free_blocks != engine.num_blocks - engine.kv.num_pinned_blocks:
        raise AssertionError("pages are still held after every request ended")
    return [finals[request_id] for request_id in ids]


def tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


class GrammarWalkProposer:
    """Drafts tokens the sequence's grammar allows, chosen at random (its own generator): never cut by the
    grammar, kept or rejected by the target's draw (for constrained sequences only)."""

    sources = ("grammar_walk",)
    source = "grammar_walk"

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.random = random.Random(seed)

    def propose(self, seq: Sequence, k: int) -> list[int]:
        import torch

        from kernels.token_mask import allowed_token_ids

        matcher = seq.grammar.copy()
        bitmask = torch.zeros(1, -(-self.vocab_size // 32), dtype=torch.int32)
        drafts: list[int] = []
        while len(drafts) < k and not matcher.is_stopped:
            matcher.fill_bitmask(bitmask, 0)
            allowed = allowed_token_ids(bitmask, self.vocab_size)[0].tolist()
            if not allowed:
                break
            token = self.random.choice(allowed)
            if not matcher.accept(token):
                break
            drafts.append(token)
        return drafts

    def forget(self, seq: Sequence) -> None:
        pass


def first_layers_checkpoint(source, destination, num_layers: int):
    """A draft checkpoint cut from `source`: its first `num_layers` layers, its embeddings, final norm and head.

    The same tokenizer by construction, a fraction of the compute, and a guess that is often right.
    """
    import json
    import re
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    source, destination = Path(source), Path(destination)
    destination.mkdir(parents=True, exist_ok=True)
    layer = re.compile(r"^model\.layers\.(\d+)\.")
    tensors = {key: value for key, value in load_file(source / "model.safetensors").items()
               if (m := layer.match(key)) is None or int(m.group(1)) < num_layers}
    save_file(tensors, destination / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (destination / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, destination / name)
    return destination

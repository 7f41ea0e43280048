"""The engine's dtype: names, "auto" by hardware, and bf16 against transformers in bf16."""

import pytest
import torch

from config import ConfigError
from runtime import Engine, SamplingParams
from runtime.dtypes import resolve_dtype

CPU = torch.device("cpu")


def test_names_resolve_and_auto_follows_the_cpu_flags():
    assert resolve_dtype("float32", CPU) is torch.float32
    assert resolve_dtype("bfloat16", CPU) is torch.bfloat16
    assert resolve_dtype("auto", CPU, frozenset({"avx2", "avx512_bf16"})) is torch.bfloat16  # e.g. EPYC Zen 4
    assert resolve_dtype("auto", CPU, frozenset({"avx512f", "amx_bf16"})) is torch.bfloat16  # e.g. Xeon with AMX
    assert resolve_dtype("auto", CPU, frozenset({"avx2", "avx512f"})) is torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float8", CPU)


def test_engine_takes_auto_and_rejects_unknown_names(stories_dir):
    engine = Engine.from_pretrained(stories_dir, num_blocks=16, dtype="auto")
    assert engine.dtype is resolve_dtype("auto", CPU)
    assert engine.runner.kv_cache.dtype is engine.dtype
    with pytest.raises(ConfigError, match="engine.dtype"):
        Engine.from_pretrained(stories_dir, num_blocks=16, dtype="half")


def test_bfloat16_logprobs_match_transformers_in_bfloat16(stories_dir, golden):
    from transformers import AutoModelForCausalLM

    prompts = [case["prompt_ids"] for case in golden["cases"][:3]]
    engine = Engine.from_pretrained(stories_dir, num_blocks=32, dtype="bfloat16")
    outputs = engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0, logprobs=5))
    model = AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    for prompt, output in zip(prompts, outputs):
        with torch.inference_mode():
            expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
        ours = output.outputs[0].logprobs[0]  # chosen token first, then the top 5 (bf16 rounding: ~0.15 here)
        assert len(ours) >= 5
        for token_id, logprob in ours.items():
            assert abs(logprob - float(expected[token_id])) < 0.25, (token_id, logprob, float(expected[token_id]))

"""The native decode step (runtime/model/native_decode.py) computes what the Python forward computes, to the bit.

Each engine runs the same requests twice, once with the native step and once without it, and every
row of logits the two produce must be equal bit for bit: through batching, a prefix-cache hit,
speculative verification rows, rows sharing a prefix (a cascade: the shared pages read once), and
each family's parts (Qwen2's q/k/v biases, Qwen3's q/k norms, Gemma 3's sandwich norms, GeGLU,
scaled embeddings and windowed layers with their own rope, a Q4_K_M mix's split q/k/v).
"""

import numpy as np
import pytest
import structlog
import torch

from runtime import Engine, SamplingParams
from runtime.model.grouped import SplitGroupedWeight
from runtime.speculative import speculator
from tests.gguf_files import family_gguf, q4_k_m_type, retyped, write_gguf
from tests.runtime.speculative.engine_helpers import NGRAM

PARAMS = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
SHARED = [1] + list(range(40, 75))  # 36 tokens: two full pages of 16 (block_size 16), shared by two prompts


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(vocab)
    return [[1] + rng.integers(3, vocab, n).tolist() for n in (5, 29, 50)]


def _llama_q4_k_m(tmp_path, stories_dir):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.1, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    source = write_gguf(tmp_path / "llama-f32.gguf", model, "llama", "F32", stories_dir / "tokenizer.model")
    return retyped(source, tmp_path / "llama-q4_k_m.gguf", q4_k_m_type)


@pytest.fixture(scope="module")
def files(tmp_path_factory, random_checkpoints, stories_dir):
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("native-decode")
    tokenizer = stories_dir / "tokenizer.model"
    qwen2 = AutoModelForCausalLM.from_pretrained(random_checkpoints["qwen2"], dtype=torch.float32)  # q/k/v biases
    return {
        "llama-q4_k_m": _llama_q4_k_m(folder, stories_dir),
        "qwen2-q8_0": write_gguf(folder / "qwen2-q8_0.gguf", qwen2, "qwen2", "Q8_0", tokenizer),
        "qwen3-q8_0": family_gguf(random_checkpoints["qwen3"], "qwen3", folder, "Q8_0", tokenizer)[1],
        "gemma3-q4_0": family_gguf(random_checkpoints["gemma3"], "gemma3", folder, "Q4_0", tokenizer)[1],
    }


Served = list[tuple[int, bool]]  # per step the native step served: its rows, and whether rows shared prefix pages


def _run(engine: Engine, native: bool, prompt_sets) -> list[tuple[list[torch.Tensor], list[list[int]], Served]]:
    """Per set of prompts, generated in turn: (every logits row computed, the outputs' tokens, per step the
    native step served: its rows, and whether rows shared prefix pages)."""
    runner = engine.runner
    step = runner.native_decode
    runner.native_decode = step if native else None
    compute_logits, native_forward = runner.model.compute_logits, step.forward
    results = []
    for prompts in prompt_sets:
        rows, served = [], []

        def logits(hidden):
            out = compute_logits(hidden)
            rows.extend(out.clone())
            return out

        def counted(input_ids, positions, meta):
            shares = any(plan.shared is not None for plan in meta.decode_plans.values())
            served.append((input_ids.shape[0], shares))
            return native_forward(input_ids, positions, meta)

        runner.model.compute_logits, step.forward = logits, counted
        outputs = engine.generate(prompts, PARAMS)
        results.append((rows, [o.outputs[0].token_ids for o in outputs], served))
    return results


def _same_bits(make_engine, prompt_sets) -> list[Served]:
    """Runs the sets of prompts in turn on a new engine with the native step, and on one without it; every
    logits row must be equal. Returns, per set, the steps the native step served (_run's)."""
    ours = _run(make_engine(), True, prompt_sets)
    theirs = _run(make_engine(), False, prompt_sets)
    for (rows, tokens, _), (reference_rows, reference_tokens, _) in zip(ours, theirs):
        assert tokens == reference_tokens
        assert len(rows) == len(reference_rows)
        for i, (a, b) in enumerate(zip(rows, reference_rows)):
            assert torch.equal(a, b), f"logits row {i} differs: {(a - b).abs().max().item()}"
    return [served for _, _, served in ours]


@pytest.mark.parametrize("name", ["llama-q4_k_m", "qwen2-q8_0", "qwen3-q8_0", "gemma3-q4_0"])
def test_native_step_gives_the_python_forwards_bits(files, name):
    with structlog.testing.capture_logs() as logs:
        engine = Engine.from_pretrained(files[name], quantization="auto", num_blocks=96, block_size=16)
    assert engine.runner.native_decode is not None
    assert any(entry["event"] == "native_decode.on" for entry in logs)
    model = engine.runner.model
    if name == "llama-q4_k_m":  # Q4_K q and k beside a Q6_K v: a split qkv
        assert isinstance(model.layers[0].self_attn.qkv_packed, SplitGroupedWeight)
    if name == "qwen2-q8_0":  # biases on q, k and v, added after the grouped matmul
        assert model.layers[0].self_attn.qkv_bias is not None
    if name == "gemma3-q4_0":  # windowed and global layers, each with its rope
        assert len(model.config.windows) == 2 and model.local_rope_cos is not None
    # batched decodes; two prompts sharing SHARED's pages, which decode through a cascade; then a prefix-cache
    # hit: SHARED's pages are cached, the prompt computes its last tokens
    sets = [_prompts(model.config.vocab_size), [SHARED + [7, 8], SHARED + [9]], [SHARED + [11, 12, 13]]]
    batched, cascade, hit = _same_bits(
        lambda: Engine.from_pretrained(files[name], quantization="auto", num_blocks=96, block_size=16), sets)
    assert len(batched) >= PARAMS.max_tokens - 1 and max(batched) == (3, False)
    assert cascade == [(2, True)] * (PARAMS.max_tokens - 1)
    assert hit == [(1, False)] * (PARAMS.max_tokens - 1)


def test_native_step_serves_speculative_verification_rows(files, monkeypatch):
    # every draft allowed: the policy's cut depends on the clock, and the two engines must draft alike
    monkeypatch.setattr(speculator, "plan_drafts", lambda gains, *rest: [len(g) for g in gains])

    def make():
        return Engine.from_pretrained(files["llama-q4_k_m"], quantization="auto", num_blocks=96, block_size=16,
                                      speculative_config=dict(NGRAM))

    repeating = [[1] + [30, 31, 32, 33] * 6, [1] + [50, 51, 52] * 9]  # n-gram drafts find matches here
    (served,) = _same_bits(make, [repeating])
    assert max(rows for rows, _ in served) > len(repeating)  # verification rows: several rows of one sequence


def test_models_the_native_step_does_not_serve_keep_the_python_forward(random_checkpoints, stories_dir, tmp_path):
    gemma2 = family_gguf(random_checkpoints["gemma2"], "gemma2", tmp_path, "Q8_0", stories_dir / "tokenizer.model")[1]
    for path, quantization, reason in ((gemma2, "auto", "soft-capped attention"),
                                       (random_checkpoints["qwen3"], "none", "matmul weight qkv is dense"),
                                       (random_checkpoints["qwen3"], "int8", "matmul weight qkv is Int8Weight")):
        with structlog.testing.capture_logs() as logs:
            engine = Engine.from_pretrained(path, quantization=quantization, num_blocks=64, block_size=16)
        assert engine.runner.native_decode is None
        assert [entry["reason"] for entry in logs if entry["event"] == "native_decode.off"] == [reason]

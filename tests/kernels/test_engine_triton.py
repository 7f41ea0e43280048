"""stories260K through the engine: greedy tokens with the Triton kernels equal the torch reference's."""

import types
from collections import Counter

import pytest

import triton  # noqa: E402,F401  a dev dependency (`make test` installs it): missing is a failure, not a skip

from kernels import attention_backends  # noqa: E402
from runtime import Engine, SamplingParams  # noqa: E402
from tests.kernels.helpers import triton_devices  # noqa: E402

PROMPTS = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside",
    "The cat sat on the mat",
]
LAUNCHERS = ("write_kv", "paged_prefill_attention", "paged_decode_attention")


@pytest.mark.parametrize("device", triton_devices())
def test_greedy_output_with_triton_kernels_equals_torch_backend(stories_dir, device, monkeypatch):
    calls = Counter()
    triton_kernels = attention_backends.triton_kernels()

    def counted(name):
        def launch(*args, **kwargs):
            calls[name] += 1
            return getattr(triton_kernels, name)(*args, **kwargs)

        return launch

    counting = types.SimpleNamespace(**{name: counted(name) for name in LAUNCHERS}, interpreted=triton_kernels.interpreted)
    monkeypatch.setattr(attention_backends, "triton_kernels", lambda: counting)
    # batches of 16 tokens: the long prompt is prefilled in chunks over its cached pages,
    # next to the other prompt's decodes, so all three kernels run
    params = SamplingParams(max_tokens=8, temperature=0)
    outputs = {}
    for backend in ("torch", "triton"):
        engine = Engine.from_pretrained(
            stories_dir, device=device, num_blocks=64, max_num_batched_tokens=16, kernel_backend=backend
        )
        outputs[backend] = [out.outputs[0].token_ids for out in engine.generate(PROMPTS, params)]
        assert all(calls[name] > 0 for name in LAUNCHERS) == (backend == "triton"), calls
    assert all(len(tokens) == 8 for tokens in outputs["torch"])
    assert outputs["triton"] == outputs["torch"]

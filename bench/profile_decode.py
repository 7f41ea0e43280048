"""Where a decode step's time goes, at batch 1 (and small batches), against the machine's read bandwidth.

    .venv/bin/python bench/profile_decode.py [--files NAME...] [--batches 1 4] [--paths native python]
                                             [--steps 64] [--quick]

For each GGUF file (bench/gguf_files.py names; default SmolLM2 Q4_0 and the random-weight
Llama-3.2-1B shape in Q4_K_M) an engine is built in this process as `pagedserve serve` builds
it (quantization auto, float32 activations), a batch of 64-token prompts is prefilled, then
`--steps` decode steps are timed, each way the layers can run (`--paths`): the native decode step
(runtime/model/native_decode.py: all layers in one C++ call) and the Python forward. On the
Python forward each part is timed in place by wrapping the function that does it (this process
only; runtime/ is not edited); in the native step the layers' parts come from its own clock
(DecodeStep.set_profiling), and "python" is then the call's time outside them (embedding, the
first norm, the call itself):

    matmul      every matmul (runtime.model.linear.linear): the layers' and the LM head's (compute_logits)
    attention   K/V writes and paged attention through the page tables (runtime.attention.paged_attention)
    norms       residual add + RMSNorm (kernels.fused_ops.add_rms_norm)
    elementwise RoPE (rope_qkv) and the gated activation (silu_and_mul / gelu_tanh_and_mul)
    python      the forward's time outside those calls: Python between ops, embedding lookup, dispatch
    prepare     the runner's inputs (ids, positions, slots, page tables) and page copies
    engine      engine.step() outside runner.execute: scheduling, sampling, stop checks, detokenizing

Bytes: the weights each step reads (every matmul weight's stored bytes, the LM head's, one
embedding row) and the K/V rows attention reads. The floor is weights / read bandwidth, the
bandwidth from a STREAM-like probe (bench/common.read_bandwidth_gbs: a sum over a buffer 8x
the last-level cache, on this process's threads). The wrappers add ~1 us a call (~0.2 ms a step
on SmolLM2), counted in their parts. Results: bench/results/profile_decode.json.
"""

from __future__ import annotations

import argparse
import time

from common import log, machine_info, pin_threads, quick_mode, read_bandwidth_gbs, wait_for_quiet, \
    write_result
from gguf_files import gguf_path

import kernels  # noqa: E402
from kernels import fused_ops  # noqa: E402
from runtime import Engine, SamplingParams  # noqa: E402
from runtime.model import linear, llama  # noqa: E402
from runtime.model.quantized import QuantizedWeight  # noqa: E402

FILES = ("smollm2-Q4_0", "llama3.2-1b-Q4_K_M")
PROMPT_LEN = 64
PARTS = ("matmul", "attention", "norms", "elementwise", "python", "prepare", "engine")


class PartTimer:
    """Seconds per part, filled by wrapping functions in the modules that call them."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PARTS + ("head", "forward", "execute", "step"), 0.0)
        self.calls = dict.fromkeys(self.seconds, 0)
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, owner, name: str, part: str) -> None:
        fn = getattr(owner, name)
        seconds, calls = self.seconds, self.calls

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[part] += time.perf_counter() - start
                calls[part] += 1

        self._undo.append((owner, name, fn))
        setattr(owner, name, timed)

    def reset(self) -> None:
        for key in self.seconds:
            self.seconds[key], self.calls[key] = 0.0, 0

    def undo(self) -> None:
        for owner, name, fn in reversed(self._undo):
            setattr(owner, name, fn)
        self._undo.clear()


def weight_bytes_per_step(model) -> int:
    """Bytes of weights one decode step reads: every layer matmul, the LM head, one embedding row."""
    total = 0
    for module, name in model.linear_slots():
        form = getattr(module, f"{name}_packed")
        weight = getattr(module, f"{name}_weight")
        total += form.nbytes() if isinstance(form, QuantizedWeight) else weight.numel() * weight.element_size()
    head = model.lm_head_packed
    total += head.nbytes() if isinstance(head, QuantizedWeight) else model.lm_head.numel() * model.lm_head.element_size()
    return total + model.config.hidden_size * 4


def profile(name: str, batch: int, steps: int, bandwidth_gbs: float, path: str) -> dict:
    engine = Engine.from_pretrained(gguf_path(name), quantization="auto", dtype="float32", num_blocks=512,
                                    max_num_seqs=max(16, batch))
    model, runner = engine.runner.model, engine.runner
    if path == "python":
        runner.native_decode = None
    native = runner.native_decode  # None: the Python forward (or a model the native step does not serve)
    timer = PartTimer()
    timer.wrap(linear, "linear", "matmul")  # every matmul: the layers' (in the forward) and the LM head's
    timer.wrap(model, "compute_logits", "head")  # the LM head and its float copy, after the forward
    timer.wrap(llama, "paged_attention", "attention")
    timer.wrap(fused_ops, "add_rms_norm", "norms")
    for op in ("rope_qkv", "silu_and_mul", "gelu_tanh_and_mul"):
        timer.wrap(fused_ops, op, "elementwise")
    if native is not None:  # the layers' parts come from the step's own clock (DecodeStep.profile)
        timer.wrap(native, "forward", "forward")
    else:
        timer.wrap(model, "forward", "forward")  # instance attribute: nn.Module.__call__ finds it first
    timer.wrap(runner, "execute", "execute")
    timer.wrap(engine, "step", "step")
    vocab = min(model.config.vocab_size, 32000)
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for i in range(batch):  # distinct prompts: no prefix sharing
        engine.add_request(f"p{i}", [1000 + (97 * i + 13 * j) % (vocab - 1000) for j in range(PROMPT_LEN)], params)
    while engine.stats()["num_waiting"] or any(s.num_tokens - s.num_computed_tokens > 1 for s in engine.scheduler.running):
        engine.step()
    for _ in range(4):  # warm
        engine.step()
    timer.reset()
    if native is not None:
        native.step.set_profiling(True)
    for _ in range(steps):
        engine.step()
    timer.undo()
    if native is not None:
        for part, seconds in native.step.profile().items():
            timer.seconds[part] += seconds
        native.step.set_profiling(False)
    if engine.stats()["num_running"] != batch:
        raise RuntimeError("a sequence finished during the timed steps")
    s = {k: v / steps * 1e3 for k, v in timer.seconds.items()}  # ms per step
    # "matmul" holds every linear call, the LM head's too (compute_logits calls linear.linear after the forward)
    parts = {"matmul": s["matmul"], "attention": s["attention"], "norms": s["norms"], "elementwise": s["elementwise"]}
    parts["python"] = s["forward"] - (s["matmul"] - s["head"] + s["attention"] + s["norms"] + s["elementwise"])
    parts["prepare"] = s["execute"] - s["forward"] - s["head"]
    parts["engine"] = s["step"] - s["execute"]
    weights = weight_bytes_per_step(model)
    context = PROMPT_LEN + steps // 2 + 4
    cfg = model.config
    kv_bytes = batch * context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    floor_ms = weights / (bandwidth_gbs * 1e9) * 1e3
    result = {
        "file": name, "path": "native" if native is not None else "python", "batch": batch, "steps": steps,
        "step_ms": s["step"],
        "parts_ms": {k: round(parts[k], 3) for k in PARTS},
        "calls_per_step": {k: timer.calls[k] / steps for k in ("matmul", "attention", "norms", "elementwise")},
        "weight_mb_per_step": weights / 1e6, "kv_mb_per_step": kv_bytes / 1e6,
        "matmul_gbs": weights / (parts["matmul"] / 1e3) / 1e9 if parts["matmul"] else None,
        "floor_ms": floor_ms, "share_of_floor": floor_ms / s["step"],
        "head_ms": s["head"],
        "outside_forward_pct": 100 * (parts["prepare"] + parts["engine"]) / s["step"],
    }
    log(f"{name} {result['path']} batch {batch}: step {s['step']:.2f} ms (floor {floor_ms:.2f} ms, {100 * result['share_of_floor']:.0f}%) | "
        + " ".join(f"{k} {parts[k]:.2f}" for k in PARTS))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", nargs="+", default=list(FILES))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--steps", type=int, default=None, help="decode steps timed (default 64; 16 with --quick)")
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (1 with --quick); the median step's run")
    parser.add_argument("--paths", nargs="+", choices=("native", "python"), default=["native", "python"],
                        help="the native decode step (runtime/model/native_decode.py), the Python forward, or both")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    quick_mode(args.quick)
    steps = args.steps or (16 if args.quick else 64)
    repeats = args.repeats or (1 if args.quick else 3)
    pin_threads()
    wait_for_quiet()
    bandwidth = read_bandwidth_gbs()
    log(f"read bandwidth {bandwidth:.1f} GB/s")
    rows = []
    for name in args.files:
        for batch in args.batches:
            for path in args.paths:
                runs = sorted((profile(name, batch, steps, bandwidth, path) for _ in range(repeats)),
                              key=lambda r: r["step_ms"])
                rows.append(runs[len(runs) // 2])
    write_result("profile_decode", args.quick, {"machine": machine_info(), "read_bandwidth_gbs": bandwidth, "rows": rows})
    for r in rows:
        print(f"{r['file']:20s} {r['path']:6s} batch {r['batch']:2d} step {r['step_ms']:6.2f} ms  floor {r['floor_ms']:5.2f} ms "
              f"({100 * r['share_of_floor']:3.0f}%)  " + "  ".join(f"{k} {r['parts_ms'][k]:.2f}" for k in PARTS))


if __name__ == "__main__":
    main()

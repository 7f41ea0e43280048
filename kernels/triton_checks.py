"""What the Triton attention launchers share: supported dtypes, the tl.dot operand choice, the
soft-cap of scores, and the input checks that turn a bad call into a clear ValueError (never an assert)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LOG2E = 1.4426950408889634  # the kernels use exp2; scores are scaled by scale * log2(e)
NO_WINDOW = 1 << 30  # a sliding window wider than any context


def dot_operands(q: torch.Tensor) -> tuple[tl.dtype, str]:
    """(operand dtype, input precision) of the kernels' tl.dot calls for q's dtype.

    float32 runs in IEEE precision (no TF32 rounding) on the GPU. Triton's interpreter (CPU
    tensors) stores bfloat16 as raw bits and cannot multiply it (triton-lang/triton#11584),
    so there bfloat16 operands are widened to float32 first; on the GPU they stay bfloat16.
    """
    if q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and not q.is_cuda):
        return tl.float32, "ieee"
    return (tl.float16 if q.dtype == torch.float16 else tl.bfloat16), "tf32"


@triton.jit
def soft_cap(scores, cap_log2):
    """Scores in log2 units (s * log2(e)) soft-capped: cap * tanh(s / cap), still in log2 units.

    cap_log2 = cap * log2(e). tanh(x) = 1 - 2 / (exp(2x) + 1), which saturates cleanly to +-1.
    """
    x = scores / cap_log2  # s / cap
    return cap_log2 * (1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0))  # exp2(2 x log2(e)) = exp(2 x)


def soft_cap_argument(op: str, softcap: float | None) -> float:
    """The kernels' cap_log2 argument (0.0 when there is no cap), after checking the cap."""
    check(op, softcap is None or softcap > 0, f"softcap must be positive or None, got {softcap}")
    return 0.0 if softcap is None else float(softcap) * LOG2E


def check(op: str, ok: bool, message: str) -> None:
    """Raise ValueError("op: message") unless ok."""
    if not ok:
        raise ValueError(f"{op}: {message}")


def check_attention_inputs(
    op: str,
    q: torch.Tensor,  # [num_rows, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    context_lens: torch.Tensor,  # int32 [num_seqs]
    sliding_window: int | None,
    out: torch.Tensor | None,
    **more: torch.Tensor,  # further int32 metadata tensors, checked for device and layout
) -> None:
    """Shapes, dtypes, devices and strides that the paged attention kernels can take."""
    check(op, q.dim() == 3, f"q must be [rows, num_q_heads, head_dim], got shape {tuple(q.shape)}")
    check(op, k_cache.dim() == 4,
          f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(k_cache.shape)}")
    check(op, v_cache.shape == k_cache.shape, f"v_cache {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
    check(op, v_cache.stride() == k_cache.stride(), "k_cache and v_cache must have the same strides")
    _, num_q_heads, head_dim = q.shape
    _, _, num_kv_heads, cache_head_dim = k_cache.shape
    check(op, q.dtype in DTYPES, f"q dtype {q.dtype} not supported; expected one of {DTYPES}")
    check(op, k_cache.dtype == q.dtype and v_cache.dtype == q.dtype,
          f"q, k_cache, v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    check(op, cache_head_dim == head_dim, f"q head_dim {head_dim} != cache head_dim {cache_head_dim}")
    check(op, head_dim <= 256, f"head_dim {head_dim} > 256 is not supported")
    check(op, num_kv_heads > 0 and num_q_heads % num_kv_heads == 0,
          f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    num_seqs = context_lens.shape[0] if context_lens.dim() == 1 else -1
    check(op, context_lens.dtype == torch.int32 and context_lens.dim() == 1,
          f"context_lens must be int32 [num_seqs], got {context_lens.dtype} {tuple(context_lens.shape)}")
    check(op, block_tables.dtype == torch.int32 and block_tables.dim() == 2 and block_tables.shape[0] == num_seqs,
          f"block_tables must be int32 [{num_seqs}, max_blocks_per_seq], "
          f"got {block_tables.dtype} {tuple(block_tables.shape)}")
    check(op, block_tables.shape[1] > 0 or num_seqs == 0, "block_tables has no columns")
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables,
               "context_lens": context_lens, **more}
    if out is not None:
        check(op, out.shape == q.shape and out.dtype == q.dtype,
              f"out must be {q.dtype} {tuple(q.shape)}, got {out.dtype} {tuple(out.shape)}")
        tensors["out"] = out
    for name, t in tensors.items():
        check(op, t.device == q.device, f"{name} is on {t.device}, q on {q.device}")
        check(op, t.numel() == 0 or t.stride(-1) == 1, f"{name} must be contiguous in its last dimension")
    check(op, sliding_window is None or sliding_window > 0,
          f"sliding_window must be positive or None, got {sliding_window}")

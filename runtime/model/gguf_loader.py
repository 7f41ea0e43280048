"""Build LlamaForCausalLM from a GGUF file, one tensor at a time, weights quantized or dense.

The model is made on the meta device (no memory), then each parameter is filled from the
file's memory map as its tensors arrive: stacked matrices (q/k/v, gate/up) wait only for
their own pieces, and each is turned at once into its final form (runtime/model/quantize.py
says which), so a 4-bit file never passes through a float32 copy of the whole model: the
peak is the kept weights plus one layer's pieces. The load log says, per tensor type, the
form it runs in (grouped4 / grouped6 / grouped8 / int4 / int8 / dense, "rows" for an embedding table kept
encoded).
"""

from __future__ import annotations

import structlog
import torch
from torch import nn
from tqdm import tqdm

from runtime.model import ggml_blocks
from runtime.model.gguf_file import GGUFCheckpoint, GGUFError, GGUFTensor
from runtime.model.grouped import GroupedWeight, SplitGroupedWeight
from runtime.model.llama import LlamaForCausalLM
from runtime.model.loader import weight_target
from runtime.model.quantize import check_quantization, gguf_form, install_linear, placeholder, quantize_float
from runtime.model.quantized import EncodedRows, Int4Weight, Int8Weight, QuantizedWeight

log = structlog.get_logger(__name__)


def _dequantized(pieces: list[GGUFTensor]) -> torch.Tensor:  # float32, the pieces' rows stacked
    return torch.cat([piece.dequantize() for piece in pieces])


def _quantized(pieces: list[GGUFTensor], form: str) -> QuantizedWeight | torch.Tensor:
    """The pieces (row blocks of one matrix, in order) as one quantized weight (float32 where they cannot be)."""
    if form.startswith("grouped"):
        if all(p.qtype in ggml_blocks.GROUPED_TYPES for p in pieces):
            return GroupedWeight.from_groups([ggml_blocks.unpack_groups(p.raw, p.qtype, *p.shape) for p in pieces])
        return _dequantized(pieces)  # stacked with a piece no kernel runs: dense, exactly (install_linear casts)
    if form == "int4" and all(p.qtype in (ggml_blocks.Q4_0, ggml_blocks.Q4_1) for p in pieces):
        unpacked = [ggml_blocks.unpack_q4(p.raw, p.qtype, *p.shape) for p in pieces]
        q, d, m = (torch.cat(parts) for parts in zip(*unpacked))
        return Int4Weight.from_q4(q, d, m)
    return quantize_float(_dequantized(pieces), form)


def _form_name(form) -> str:
    """How a filled weight runs, for the load log."""
    if isinstance(form, (GroupedWeight, SplitGroupedWeight)):
        return form.form
    if isinstance(form, QuantizedWeight):
        return {Int4Weight: "int4", Int8Weight: "int8"}[type(form)]
    return "rows" if isinstance(form, EncodedRows) else "dense"


def _encoded_rows(piece: GGUFTensor) -> EncodedRows:
    """An embedding table kept in the file's own encoding (a copy: the memory map is dropped after loading)."""
    return EncodedRows(torch.from_numpy(piece.raw.copy()).view(piece.shape[0], -1), piece.qtype, piece.shape[1])


def load_gguf_model(checkpoint: GGUFCheckpoint, device: torch.device, dtype: torch.dtype, quantization: str = "auto",
                    show_progress: bool = True) -> LlamaForCausalLM:
    """The model of `checkpoint` on `device`, its matmul weights in the forms `quantization` picks."""
    check_quantization(quantization, device)
    config = checkpoint.model_config()
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    # the dicts below are keyed by id(meta parameter); `originals` keeps those parameters alive while
    # loading replaces them, so no new object can take one of their ids
    originals = list(model.parameters())  # noqa: F841
    owners = {id(p): (module, name) for module in model.modules() for name, p in module.named_parameters(recurse=False)}
    slots = {id(getattr(module, f"{name}_weight")): (module, name) for module, name in model.linear_slots()}
    pending: dict[int, list[tuple[slice, GGUFTensor]]] = {}  # id(param) -> pieces so far
    filled: set[int] = set()
    forms: dict[str, set[str]] = {}  # tensor type -> the forms its tensors run in
    params = {id(p): name for name, p in model.named_parameters(remove_duplicate=True)}
    tensors = list(checkpoint.tensors())
    with tqdm(total=len(tensors), desc="loading GGUF", unit="tensor", disable=not show_progress) as bar:
        for tensor in tensors:
            bar.update(1)
            target = weight_target(model, tensor.name)
            if target is None:
                log.debug("GGUF tensor unused", tensor=tensor.gguf_name)
                continue
            param, rows = target
            expected = tuple(param[rows].shape)
            if tuple(tensor.shape) != expected:
                raise GGUFError(f"{checkpoint.path}: tensor {tensor.gguf_name} has shape {list(tensor.shape)}, "
                                f"expected {list(expected)} from the metadata")
            pieces = pending.setdefault(id(param), [])
            pieces.append((rows, tensor))
            if sum(t.shape[0] for _, t in pieces) < param.shape[0]:
                continue  # a stacked matrix still waiting for its other pieces
            pieces.sort(key=lambda piece: piece[0].start or 0)
            ordered = [t for _, t in pieces]
            del pending[id(param)]
            piece_forms = _fill(model, param, ordered, slots, owners, quantization, device, dtype)
            for piece, form in zip(ordered, piece_forms):
                forms.setdefault(piece.type_name, set()).add(form)
            filled.add(id(param))
    missing = [name for pid, name in params.items() if pid not in filled]
    if missing:
        raise GGUFError(f"{checkpoint.path}: tensors missing from the file for {missing[:5]}")
    if config.tie_word_embeddings:
        model.lm_head = model.embed_tokens
    model.place(device, dtype)
    log.info("GGUF loaded", path=str(checkpoint.path), quantization=quantization, types=checkpoint.tensor_types,
             forms={name: "+".join(sorted(kinds)) for name, kinds in sorted(forms.items())},
             weight_mib=round(model.weight_bytes() / 2**20, 1))
    return model


def _fill(model: LlamaForCausalLM, param: nn.Parameter, pieces: list[GGUFTensor], slots, owners, quantization: str,
          device: torch.device, dtype: torch.dtype) -> list[str]:
    """Put one whole parameter, made of `pieces`, into the model in its final form; returns each piece's form."""
    if id(param) in slots:  # a layer's matmul weight
        module, name = slots[id(param)]
        form = gguf_form(quantization, pieces[0].qtype, device, False, dtype)
        weight = _dequantized(pieces).to(device) if form == "dense" else _quantized(pieces, form)
        install_linear(module, name, weight, dtype)
        return weight.piece_forms if isinstance(weight, SplitGroupedWeight) else [_form_name(weight)] * len(pieces)
    if param is model.embed_tokens or param is model.lm_head:
        return [_fill_table(model, pieces[0], param is model.embed_tokens, quantization, device, dtype)]
    owner, attr = owners[id(param)]  # a norm, or a bias (q/k/v biases stacked like their weights)
    setattr(owner, attr, nn.Parameter(_dequantized(pieces).to(device=device, dtype=dtype), requires_grad=False))
    return ["dense"] * len(pieces)


def _fill_table(model: LlamaForCausalLM, piece: GGUFTensor, is_embedding: bool, quantization: str,
                device: torch.device, dtype: torch.dtype) -> str:
    """token_embd (also the LM head when tied) or output: dense, or quantized with rows looked up apart.

    Returns the form's name (a tied table: the LM head's)."""
    tied = model.config.tie_word_embeddings
    serves_head = tied or not is_embedding
    form = gguf_form(quantization, piece.qtype, device, True, dtype) if serves_head else "dense"
    if is_embedding and not tied and piece.qtype not in (ggml_blocks.F32, ggml_blocks.F16, ggml_blocks.BF16) \
            and device.type == "cpu" and quantization != "none":
        model.embed_rows = _encoded_rows(piece)
        model.embed_tokens = placeholder(dtype)
        return "rows"
    if form == "dense":
        table = nn.Parameter(piece.dequantize().to(device=device, dtype=dtype), requires_grad=False)
        if is_embedding:
            model.embed_tokens = table
        else:
            model.lm_head = table
        return "dense"
    head = _quantized([piece], form)
    model.lm_head_packed = head
    if is_embedding:  # tied: rows looked up from the same table (int8, the file's groups), or the file's blocks (int4)
        model.embed_rows = head if isinstance(head, (Int8Weight, GroupedWeight)) else _encoded_rows(piece)
        model.embed_tokens = placeholder(dtype)
    else:
        model.lm_head = placeholder(dtype)
    return _form_name(head)

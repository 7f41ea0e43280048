"""Any checkpoint the runtime serves, loaded into a LlamaForCausalLM: a Hugging Face folder or a GGUF file.

The engine loads its model here, and a draft model (speculative decoding) loads the same way.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path

import structlog
import torch

from runtime.model.config import load_model_config
from runtime.model.gguf_file import GGUFCheckpoint, is_gguf_path
from runtime.model.gguf_loader import load_gguf_model
from runtime.model.llama import LlamaForCausalLM
from runtime.model.loader import load_model
from runtime.model.quantize import check_quantization, quantize_model
from runtime.tokenizer import HFTokenizer, start_gguf_build

log = structlog.get_logger(__name__)


def _return_freed_memory() -> None:
    """Give the heap's freed pages back to the OS (glibc keeps them after loading's temporaries: ~300 MiB
    of a 1B Q4_K_M file's unpacking stayed resident); nothing where there is no glibc."""
    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


def load_checkpoint(path: str | Path, device: torch.device, dtype: torch.dtype, quantization: str,
                    show_progress: bool = False, with_tokenizer: bool = True) -> tuple[LlamaForCausalLM, HFTokenizer | None, str]:
    """(the model, its tokenizer (None unless asked), its name) for a checkpoint folder or a .gguf file.

    Raises UnsupportedModelError (a ValueError) for a checkpoint of an architecture not run here.
    """
    path = Path(path)
    if is_gguf_path(path):
        checkpoint = GGUFCheckpoint(path)
        config = checkpoint.model_config()
        log.info("loading GGUF", path=str(path), architecture=checkpoint.architecture, layers=config.num_layers,
                 types=checkpoint.tensor_types, quantization=quantization)
        build = start_gguf_build(path, checkpoint) if with_tokenizer else None  # a child builds it meanwhile
        try:
            net = load_gguf_model(checkpoint, device, dtype, quantization, show_progress=show_progress)
        except BaseException:
            if build is not None:
                build.cancel()
            raise
        tokenizer = HFTokenizer.from_gguf(path, checkpoint, build) if build is not None else None
        checkpoint.close()
        _return_freed_memory()
        return net, tokenizer, path.name.removesuffix(".gguf")
    config = load_model_config(path)
    log.info("loading model", path=str(path), model_type=config.model_type, layers=config.num_layers)
    check_quantization(quantization, device)
    net = load_model(config, path, device, dtype, show_progress=show_progress)
    quantize_model(net, quantization)
    _return_freed_memory()
    return net, HFTokenizer(path) if with_tokenizer else None, path.name

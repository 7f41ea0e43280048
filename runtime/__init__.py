"""The paged-KV runtime: pages, scheduler, model, sampler. Pure Python + torch, no I/O."""

from runtime.engine import Engine
from runtime.outputs import CompletionOutput, RequestOutput
from runtime.sampling_params import InvalidRequestError, SamplingParams

__all__ = ["CompletionOutput", "Engine", "InvalidRequestError", "RequestOutput", "SamplingParams"]

"""Sampling in batch form: a step's rows' parameters as tensors (`SamplingMetadata`), and the row-wise ops every
sampling path runs (runtime/sampler.py: plain rows all at once; a grammar's or a verification's row as a batch of one)."""

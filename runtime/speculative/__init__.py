"""Speculative decoding: cheap drafts, verified by the target in one forward, the answer unchanged."""

"""A bridge's loop-side table of live streams, and what admission counts in it."""

from __future__ import annotations

from collections import Counter

from service.streams import RequestStream


class StreamsInFlight:
    """A bridge's loop-side table of live streams (request id -> stream), and what admission counts in it."""

    streams: dict[str, RequestStream]

    @property
    def num_inflight(self) -> int:
        return len(self.streams)

    @property
    def num_inflight_sequences(self) -> int:
        return sum(stream.n for stream in self.streams.values())

    def inflight_sequences_by_tenant(self) -> Counter[str]:
        """Sequences in flight per tenant."""
        counts: Counter[str] = Counter()
        for stream in self.streams.values():
            counts[stream.tenant] += stream.n
        return counts

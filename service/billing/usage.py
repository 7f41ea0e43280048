"""Usage records and prices, in exact integers: micro-USD per million tokens in, pico-USD out.

A price of P micro-USD per million tokens costs P * 1e-6 USD / 1e6 tokens = P pico-USD per token,
so `tokens * price` is the cost in pico-USD (1e-12 USD) with no rounding anywhere:

    price 0.50 USD/Mtok   -> 500_000 micro-USD/Mtok
    3_400 tokens at 0.50  -> 3_400 * 500_000 = 1_700_000_000 pico-USD = "0.0017" USD

Floats appear only at the edge, in `PricePlan.from_usd`, which goes through `Decimal(str(value))`
and refuses a price that is not a whole number of micro-USD per million tokens.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation, localcontext

import msgspec

PICO_PER_USD = 10**12
MICRO_PER_USD = 10**6


class UsageRecord(msgspec.Struct, frozen=True):
    """What one finished request used. Times are unix seconds."""

    request_id: str
    tenant: str
    model: str
    prompt_tokens: int  # all input, cached included
    cached_tokens: int  # the part of prompt_tokens served from shared pages
    completion_tokens: int
    finish_reason: str
    created_at: float  # arrival
    finished_at: float

    def check_counts(self) -> None:
        """Raise ValueError unless every count is >= 0 and cached_tokens <= prompt_tokens."""
        for name in ("prompt_tokens", "cached_tokens", "completion_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"usage record {self.request_id!r}: {name} must be an int >= 0, got {value!r}")
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError(f"usage record {self.request_id!r}: cached_tokens ({self.cached_tokens}) "
                             f"exceeds prompt_tokens ({self.prompt_tokens})")


def _micro_usd(field: str, value: object) -> int:
    """USD per Mtok (float, int or decimal string) -> exact micro-USD per Mtok."""
    if isinstance(value, bool):
        raise ValueError(f"{field}: expected a price in USD per million tokens, got {value!r}")
    try:
        usd = Decimal(str(value))
    except InvalidOperation:
        raise ValueError(f"{field}: {value!r} is not a number") from None
    if not usd.is_finite():
        raise ValueError(f"{field}: {value!r} is not a finite price")
    if usd < 0:
        raise ValueError(f"{field}: a price cannot be negative, got {value!r}")
    with localcontext() as ctx:
        ctx.prec = 60  # exact for any price a TOML file can hold
        micro = usd.scaleb(6)
    if micro != micro.to_integral_value():
        raise ValueError(f"{field}: {value!r} has more precision than 0.000001 USD per million tokens")
    return int(micro)


class PricePlan(msgspec.Struct, frozen=True):
    """Prices as exact integers of micro-USD per million tokens (= pico-USD per token)."""

    input_micro_usd_per_mtok: int
    cached_input_micro_usd_per_mtok: int
    output_micro_usd_per_mtok: int

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")

    @classmethod
    def from_usd(cls, *, input_per_mtok: object, cached_input_per_mtok: object,
                 output_per_mtok: object) -> PricePlan:
        """Build a plan from USD-per-million-token prices as written in the tenants TOML (0.50, "0.055")."""
        return cls(
            input_micro_usd_per_mtok=_micro_usd("input_per_mtok", input_per_mtok),
            cached_input_micro_usd_per_mtok=_micro_usd("cached_input_per_mtok", cached_input_per_mtok),
            output_micro_usd_per_mtok=_micro_usd("output_per_mtok", output_per_mtok),
        )


def cost_pico_usd(record: UsageRecord, plan: PricePlan) -> int:
    """The exact cost of `record` under `plan`, in pico-USD; cached input is billed at the cached rate."""
    record.check_counts()
    fresh_tokens = record.prompt_tokens - record.cached_tokens
    return (fresh_tokens * plan.input_micro_usd_per_mtok
            + record.cached_tokens * plan.cached_input_micro_usd_per_mtok
            + record.completion_tokens * plan.output_micro_usd_per_mtok)


def format_usd(pico: int) -> str:
    """Pico-USD -> an exact decimal string of USD: 1_692_000_000 -> "0.001692", 0 -> "0"."""
    if not isinstance(pico, int) or isinstance(pico, bool):
        raise TypeError(f"format_usd takes an int of pico-USD, got {type(pico).__name__}")
    sign = "-" if pico < 0 else ""
    whole, frac = divmod(abs(pico), PICO_PER_USD)
    digits = f"{frac:012d}".rstrip("0")
    return f"{sign}{whole}.{digits}" if digits else f"{sign}{whole}"


class UsageTotals(msgspec.Struct):
    """Sums over a tenant's usage records."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cost_pico_usd: int = 0

    def add(self, record: UsageRecord, cost_pico: int) -> None:
        """Count one record in."""
        self.requests += 1
        self.prompt_tokens += record.prompt_tokens
        self.cached_tokens += record.cached_tokens
        self.completion_tokens += record.completion_tokens
        self.cost_pico_usd += cost_pico

    def to_json(self, tenant: str) -> dict:
        """The body of GET /v1/usage: counts as ints, cost as an exact decimal string."""
        return {
            "tenant": tenant,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "cost_usd": format_usd(self.cost_pico_usd),
        }

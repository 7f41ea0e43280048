"""service/billing/usage.py: exact prices, costs and USD strings."""

from decimal import Decimal

import pytest

from service.billing.usage import PricePlan, UsageRecord, UsageTotals, cost_pico_usd, format_usd

STANDARD = PricePlan.from_usd(input_per_mtok=0.50, cached_input_per_mtok=0.05, output_per_mtok=1.50)


def record(prompt=0, cached=0, completion=0, request_id="r1") -> UsageRecord:
    return UsageRecord(request_id, "acme", "stories", prompt, cached, completion, "stop", 1000.0, 1001.0)


@pytest.mark.parametrize("pico, text", [
    (0, "0"),
    (1, "0.000000000001"),
    (1_692_000_000, "0.001692"),
    (10**12, "1"),
    (1_500_000_000_000, "1.5"),
    (123_456_789_012_345_678, "123456.789012345678"),
    (10**30, "1" + "0" * 18),
    (-500_000_000_000, "-0.5"),
])
def test_format_usd_is_exact(pico, text):
    assert format_usd(pico) == text
    assert Decimal(text) == Decimal(pico) / 10**12


def test_format_usd_refuses_floats():
    with pytest.raises(TypeError):
        format_usd(1.5)


def test_price_plan_from_usd_stores_micro_usd_per_mtok():
    plan = PricePlan.from_usd(input_per_mtok=0.50, cached_input_per_mtok="0.055", output_per_mtok=2)
    assert (plan.input_micro_usd_per_mtok, plan.cached_input_micro_usd_per_mtok, plan.output_micro_usd_per_mtok) \
        == (500_000, 55_000, 2_000_000)
    assert PricePlan.from_usd(input_per_mtok=1e-6, cached_input_per_mtok="0.5000000000",
                              output_per_mtok=Decimal("12.345678")) \
        == PricePlan(1, 500_000, 12_345_678)


@pytest.mark.parametrize("field, value, words", [
    ("input_per_mtok", "0.0000001", "more precision than 0.000001"),
    ("cached_input_per_mtok", 0.1 + 0.2, "more precision than 0.000001"),  # 0.30000000000000004
    ("output_per_mtok", "1.0000005", "more precision than 0.000001"),
    ("input_per_mtok", -0.5, "cannot be negative"),
    ("output_per_mtok", "abc", "is not a number"),
    ("cached_input_per_mtok", float("nan"), "is not a finite price"),
    ("input_per_mtok", True, "expected a price"),
])
def test_price_plan_rejects_bad_prices_naming_the_field(field, value, words):
    prices = {"input_per_mtok": 0.5, "cached_input_per_mtok": 0.05, "output_per_mtok": 1.5, field: value}
    with pytest.raises(ValueError, match=rf"^{field}: .*{words}"):
        PricePlan.from_usd(**prices)


def test_price_plan_rejects_negative_micro_prices():
    with pytest.raises(ValueError, match="output_micro_usd_per_mtok must be an int >= 0"):
        PricePlan(1, 1, -1)


def test_cost_bills_cached_input_at_the_cached_rate():
    # 1352 fresh * 500_000 + 2048 cached * 50_000 + 900 out * 1_500_000
    usage = record(prompt=3400, cached=2048, completion=900)
    assert cost_pico_usd(usage, STANDARD) == 676_000_000 + 102_400_000 + 1_350_000_000
    assert format_usd(cost_pico_usd(usage, STANDARD)) == "0.0021284"


def test_cost_of_nothing_is_zero():
    assert cost_pico_usd(record(), STANDARD) == 0


@pytest.mark.parametrize("counts, words", [
    ((10, 11, 0), r"cached_tokens \(11\) exceeds prompt_tokens \(10\)"),
    ((-1, 0, 0), "prompt_tokens must be an int >= 0"),
    ((5, -1, 0), "cached_tokens must be an int >= 0"),
    ((5, 0, -3), "completion_tokens must be an int >= 0"),
])
def test_cost_rejects_impossible_counts(counts, words):
    with pytest.raises(ValueError, match=words):
        cost_pico_usd(record(*counts), STANDARD)


def test_totals_to_json_has_the_usage_endpoint_shape():
    totals = UsageTotals()
    totals.add(record(prompt=3400, cached=2048, completion=900), 1_692_000_000)
    assert totals.to_json("acme") == {
        "tenant": "acme", "requests": 1, "prompt_tokens": 3400, "cached_tokens": 2048,
        "completion_tokens": 900, "cost_usd": "0.001692",
    }

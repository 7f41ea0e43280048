"""Tenants: API keys (sha256 only), price plans, limits, cache salts, operator-shared prefixes.

The tenants file (TOML, `--tenants FILE`; example in config/tenants.example.toml):

    admin_keys_sha256 = ["<hex>"]          # may read any tenant's usage and the prefix index
    [plans.standard]                       # USD per million tokens
    input_per_mtok = 0.50
    cached_input_per_mtok = 0.05
    output_per_mtok = 1.50
    weight = 1                             # share of the engine under engine.scheduling = "fair" (default 1)
    pinned_pages = 16                      # KV pages the tenant's pins may hold (default: an equal share of
                                           # engine.pinned_block_budget among the tenants)
    [plans.standard.models."stories260K"]  # optional per-model prices
    input_per_mtok = 0.10 ...
    [tenants.acme]
    keys_sha256 = ["<hex sha256 of an API key>"]
    plan = "standard"
    requests_per_minute = 600              # optional limits
    tokens_per_minute = 200000
    max_concurrent = 32
    [[shared_prefixes]]                    # cached once for every tenant
    name = "public-assistant"              # also matches a request's prompt_cache_key
    text = "system: You are a helpful assistant."

With no file the server runs open: every caller is tenant "default" on a free plan.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from config import ConfigError
from service.errors import APIError
from service.rate_limit import Limits
from service.billing.usage import PricePlan

DEFAULT_TENANT = "default"


class PlanPrices(msgspec.Struct, forbid_unknown_fields=True):
    input_per_mtok: float | str = 0
    cached_input_per_mtok: float | str = 0
    output_per_mtok: float | str = 0


class PlanConfig(PlanPrices, forbid_unknown_fields=True):
    models: dict[str, PlanPrices] = {}
    weight: float = 1.0  # the plan's share under fair scheduling (runtime/fairness.py)
    pinned_pages: int | None = None  # pages its tenants' pins may hold each; None: an equal share of the pin budget


class TenantConfig(msgspec.Struct, forbid_unknown_fields=True):
    keys_sha256: list[str]
    plan: str
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None


class SharedPrefixConfig(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    text: str


class TenantsFile(msgspec.Struct, forbid_unknown_fields=True):
    plans: dict[str, PlanConfig] = {}
    tenants: dict[str, TenantConfig] = {}
    admin_keys_sha256: list[str] = []
    shared_prefixes: list[SharedPrefixConfig] = []


def _plan(prices: PlanPrices, where: str) -> PricePlan:
    try:
        return PricePlan.from_usd(input_per_mtok=prices.input_per_mtok,
                                  cached_input_per_mtok=prices.cached_input_per_mtok,
                                  output_per_mtok=prices.output_per_mtok)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


@dataclass(frozen=True)
class Tenant:
    """An authenticated caller's account."""

    tenant_id: str
    plan: PricePlan
    model_plans: dict[str, PricePlan] = field(default_factory=dict)
    limits: Limits = field(default_factory=Limits)
    is_admin: bool = False
    weight: float = 1.0  # its plan's share of the engine under fair scheduling
    pinned_pages: int | None = None  # pages its pins may hold (service/pin_budget.py); None: an equal share

    def price_plan(self, model: str) -> PricePlan:
        return self.model_plans.get(model, self.plan)


FREE = PricePlan.from_usd(input_per_mtok=0, cached_input_per_mtok=0, output_per_mtok=0)


class TenantDirectory:
    """Finds the tenant for an API key (constant-time compares) and derives its cache salt."""

    def __init__(self, tenants: dict[str, Tenant], key_hashes: list[tuple[bytes, str]],
                 admin_hashes: list[bytes], shared_prefixes: list[SharedPrefixConfig], salt_secret: bytes,
                 is_open: bool = False) -> None:
        self.tenants = tenants
        self._key_hashes = key_hashes  # (sha256 digest, tenant id)
        self._admin_hashes = admin_hashes
        self.shared_prefixes = shared_prefixes
        self._salt_secret = salt_secret
        self.is_open = is_open  # only without a tenants file; a file with no keys admits nobody
        self._prefix_ids: dict[tuple[str, bool], list[int]] = {}  # shared prefix text -> token ids

    @classmethod
    def open(cls, salt_secret: bytes | None = None) -> TenantDirectory:
        """No tenants file: everyone is tenant "default", free, unlimited."""
        tenants = {DEFAULT_TENANT: Tenant(DEFAULT_TENANT, FREE)}
        return cls(tenants, [], [], [], salt_secret or secrets.token_bytes(32), is_open=True)

    @classmethod
    def from_file(cls, path: str | Path, salt_secret: bytes | None = None) -> TenantDirectory:
        try:
            raw = tomllib.loads(Path(path).read_text())
            spec = msgspec.convert(raw, TenantsFile)
        except (OSError, tomllib.TOMLDecodeError, msgspec.ValidationError) as exc:
            raise ConfigError(f"tenants file {path}: {exc}") from exc
        plans = {name: _plan(plan, f"plans.{name}") for name, plan in spec.plans.items()}
        tenants: dict[str, Tenant] = {}
        key_hashes: list[tuple[bytes, str]] = []
        for tenant_id, config in spec.tenants.items():
            if config.plan not in plans:
                raise ConfigError(f"tenants.{tenant_id}.plan: no plan named {config.plan!r}")
            plan_config = spec.plans[config.plan]
            if not plan_config.weight > 0:
                raise ConfigError(f"plans.{config.plan}.weight must be > 0, got {plan_config.weight}")
            if plan_config.pinned_pages is not None and plan_config.pinned_pages < 0:
                raise ConfigError(f"plans.{config.plan}.pinned_pages must be >= 0, got {plan_config.pinned_pages}")
            model_plans = {m: _plan(p, f"plans.{config.plan}.models.{m}") for m, p in plan_config.models.items()}
            limits = Limits(requests_per_minute=config.requests_per_minute,
                            tokens_per_minute=config.tokens_per_minute, max_concurrent=config.max_concurrent)
            tenants[tenant_id] = Tenant(tenant_id, plans[config.plan], model_plans, limits, weight=plan_config.weight,
                                        pinned_pages=plan_config.pinned_pages)
            for hex_digest in config.keys_sha256:
                key_hashes.append((_digest(hex_digest, f"tenants.{tenant_id}.keys_sha256"), tenant_id))
        admin = [_digest(h, "admin_keys_sha256") for h in spec.admin_keys_sha256]
        return cls(tenants, key_hashes, admin, spec.shared_prefixes, salt_secret or secrets.token_bytes(32))

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant for `Authorization: Bearer KEY`; 401 in the OpenAI shape otherwise."""
        if self.is_open:
            return self.tenants[DEFAULT_TENANT]
        if not authorization or not authorization.startswith("Bearer "):
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", None, "invalid_api_key")
        digest = hashlib.sha256(authorization[len("Bearer "):].strip().encode()).digest()
        found = None
        for known, tenant_id in self._key_hashes:  # no early exit: every key is compared
            if hmac.compare_digest(known, digest):
                found = tenant_id
        is_admin = False
        for known in self._admin_hashes:
            if hmac.compare_digest(known, digest):
                is_admin = True
        if found is None and not is_admin:
            raise APIError(401, "invalid API key", None, "invalid_api_key")
        if found is None:
            return Tenant("admin", FREE, is_admin=True)
        tenant = self.tenants[found]
        return tenant if not is_admin else dataclasses.replace(tenant, is_admin=True)

    def cache_salt(self, tenant_id: str, client_salt: str | None = None) -> bytes:
        """HMAC(secret, tenant [+ client salt]): a client salt can only split a tenant's cache further."""
        message = tenant_id.encode() + (b"\x00" + client_salt.encode() if client_salt else b"")
        return hmac.new(self._salt_secret, message, hashlib.sha256).digest()

    def shared_prefix_len(self, prompt_token_ids: list[int], encode, prompt_cache_key: str | None = None) -> int:
        """Tokens at the start of the prompt that an operator marked as shared (0 if none)."""
        best = 0
        for prefix in self.shared_prefixes:
            if prompt_cache_key is not None and prefix.name != prompt_cache_key:
                continue
            for with_bos in (True, False):
                key = (prefix.text, with_bos)
                ids = self._prefix_ids.get(key)
                if ids is None:
                    ids = self._prefix_ids[key] = encode(prefix.text, with_bos)
                if len(ids) > best and prompt_token_ids[: len(ids)] == ids:
                    best = len(ids)
        return best


def _digest(hex_digest: str, where: str) -> bytes:
    try:
        digest = bytes.fromhex(hex_digest)
    except ValueError as exc:
        raise ConfigError(f"{where}: {hex_digest!r} is not hex") from exc
    if len(digest) != 32:
        raise ConfigError(f"{where}: expected a sha256 hex digest (64 hex characters)")
    return digest

"""Can one tenant learn another's prompt from the clock? The prefix cache as a side channel, measured.

A victim tenant keeps a secret system prompt cached (it sends it again every few probes, as a
live victim would). An attacker tenant sends N probes whose first pages are the secret's
tokens ("hit" probes: they would hit, were the cache shared) and N whose first pages are the
same tokens shuffled ("miss" probes), interleaved in random order, each a streamed
completion of one token, and times its own first token. A two-sample Kolmogorov-Smirnov test
(Gu et al., "Auditing Prompt Caching", ICML 2025) asks whether the two sets of times differ:

    salted   the secret is the victim's own (its tenant's salt): nothing to see, p > 0.05
    control  the secret is an operator-shared prefix (one scope for every tenant, on purpose):
             the same probes must see the hit, p < 0.001, or the probe could not see a leak

Every probe carries a fresh `cache_salt` of the attacker's own, so no probe can hit the
attacker's earlier probes: the only pages a probe could hit are someone else's (or, in the
control, the operator's). Besides the clock, each probe's `usage.prompt_tokens_details.
cached_tokens` is kept: in the salted run it must be 0 for every probe.

Deployments (real processes on 127.0.0.1, stories260K unless --model):
    embedded  one `pagedserve serve`
    redis     two `pagedserve serve` replicas sharing Redis (ledger, limits, prefix index); the
              attacker's probes alternate between them as a load balancer's would, and the
              admin prefix-index lookup (what a Redis-index router reads) is asked what it sees
              of the secret under the attacker's salt
    dynamo    two `pagedserve worker`s behind Dynamo's KV-aware router and a front door: the
              router must not send the attacker's guesses to the victim's worker

    .venv/bin/python bench/side_channel.py [--quick] [--probes 500] [--only embedded,redis,dynamo]

The tests (tests/service/test_side_channel.py) run the same attack with 200 probes of each kind.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import requests

from bench.common import STORIES, log, machine_info, write_result

VICTIM_KEY, ATTACKER_KEY, ADMIN_KEY = "sk-victim", "sk-attacker", "sk-admin"
SALT_SECRET = "side-channel-bench"
SECRET_TEXT = ("Confidential: the merger of Northwind and Contoso closes on the ninth of March at a price of "
               "forty-two dollars a share. The board met in the small room by the river and nobody outside it "
               "knows the date, the price or the name of the bank that will carry the deal. The lawyers wrote "
               "the papers at night, the clerks were sent home early, and the phones in the big hall were turned "
               "off so that no word of it could reach the papers in town before the last page was signed. Only "
               "three people hold the keys to the files: the chair, the old treasurer and the young lawyer from "
               "the north, and each of them has promised to keep the secret until the bells ring on the day. ")
OPERATOR_TEXT = ("House rules for every assistant on this deployment: answer in plain words, keep to the story, be "
                 "kind, never make up facts about real people, say when you do not know, and end each answer with "
                 "a short question that helps the reader go on with the tale of the day. When a child asks for a "
                 "story, tell one about a dog, a cat or a bird in a park, with a happy end and a lesson about "
                 "sharing. When a grown up asks for help with a letter, keep it short and polite, and let them "
                 "choose the words that matter most. Never shout, never tease, and always thank the reader. ")
DEPLOYMENTS = ("embedded", "redis", "dynamo")
VICTIM_EVERY = 8  # the victim sends its prompt again every this many probes, so its pages stay cached


def kolmogorov_q(lam: float) -> float:
    """P(K > lam) for the Kolmogorov distribution: 2 * sum_j (-1)^(j-1) exp(-2 j^2 lam^2)."""
    if lam < 0.2:
        return 1.0
    total = 0.0
    for j in range(1, 101):
        term = 2.0 * (-1) ** (j - 1) * math.exp(-2.0 * j * j * lam * lam)
        total += term
        if abs(term) < 1e-12:
            break
    return min(1.0, max(0.0, total))


def ks_2samp(a: list[float], b: list[float]) -> tuple[float, float]:
    """Two-sample Kolmogorov-Smirnov test: (D, p). D is the largest gap between the samples'
    empirical distribution functions; p is the asymptotic two-sided p-value with Stephens'
    small-sample correction, lam = (sqrt(ne) + 0.12 + 0.11 / sqrt(ne)) * D, ne = n m / (n + m)."""
    if not a or not b:
        raise ValueError("both samples need at least one value")
    xs, ys = sorted(a), sorted(b)
    n, m = len(xs), len(ys)
    i = j = 0
    gap = 0.0
    while i < n and j < m:
        value = min(xs[i], ys[j])
        while i < n and xs[i] == value:
            i += 1
        while j < m and ys[j] == value:
            j += 1
        gap = max(gap, abs(i / n - j / m))
    ne = n * m / (n + m)
    root = math.sqrt(ne)
    return gap, kolmogorov_q((root + 0.12 + 0.11 / root) * gap)


@dataclass
class Deployment:
    """Servers an attacker reaches: `urls` in turn (a load balancer's round robin); `admin_url` answers the
    admin prefix-index lookup; `stop()` ends every process."""

    name: str
    urls: list[str]
    admin_url: str
    model: str = ""  # the served model's name
    worker_urls: list[str] = field(default_factory=list)  # behind Dynamo: the workers' own /stats
    processes: list = field(default_factory=list)
    redis: object | None = None

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()
        if self.redis is not None:
            self.redis.stop()
            self.redis.remove_socket_dir()


def _sha256(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def write_tenants_file(path: Path) -> Path:
    """victim and attacker on one plan; an admin key; the operator-shared prefix (the control's secret)."""
    path.write_text("\n".join([
        f'admin_keys_sha256 = ["{_sha256(ADMIN_KEY)}"]',
        "[plans.standard]", "input_per_mtok = 0.5", "cached_input_per_mtok = 0.05", "output_per_mtok = 1.5",
        "[tenants.victim]", f'keys_sha256 = ["{_sha256(VICTIM_KEY)}"]', 'plan = "standard"',
        "[tenants.attacker]", f'keys_sha256 = ["{_sha256(ATTACKER_KEY)}"]', 'plan = "standard"',
        "[[shared_prefixes]]", 'name = "house-rules"', f'text = "{OPERATOR_TEXT}"', "",
    ]))
    return path


def start(name: str, model: Path, root: Path, num_blocks: int = 1024) -> Deployment:
    """Start deployment `name` (one of DEPLOYMENTS) in folder `root`; ready when this returns."""
    from tests.distributed.cluster import start_front_door, start_worker
    from tests.processes import Process
    from tests.service.redis_fixture import start_server

    tenants = write_tenants_file(root / "tenants.toml")
    env = {"PAGEDSERVE_SERVER_CACHE_SALT_SECRET": SALT_SECRET, "PAGEDSERVE_SERVER_LOG_LEVEL": "warning"}
    engine = ("--num-blocks", str(num_blocks))
    deployment = Deployment(name, [], "")
    try:
        if name == "embedded":  # port 0: each server binds its own and says which (tests/processes.py)
            deployment.processes.append(Process("server", ["serve", "--model", str(model), "--port", "0",
                                                           "--tenants", str(tenants), "--data-dir", str(root / "data"),
                                                           *engine], 0, root, env))
        elif name == "redis":
            deployment.redis = start_server(root / "redis")
            for i in range(2):
                deployment.processes.append(Process(f"replica-{i}", [
                    "serve", "--model", str(model), "--port", "0", "--tenants", str(tenants), "--data-dir",
                    str(root / f"data-{i}"), "--redis-url", deployment.redis.url, *engine], 0, root, env))
        elif name == "dynamo":
            discovery = root / "discovery"
            workers = [start_worker(f"worker-{i}", model, discovery, root, *engine, env=env) for i in range(2)]
            deployment.processes += workers
            for worker in workers:
                worker.wait_ready()
            deployment.processes.append(start_front_door(model, discovery, root / "data", root, "--tenants",
                                                         str(tenants), env=env))
        else:
            raise ValueError(f"deployment must be one of {DEPLOYMENTS}, got {name!r}")
        for process in deployment.processes:
            process.wait_ready(check=(lambda body: body["workers"] == 2) if name == "dynamo" and
                               process.name == "front-door" else (lambda body: True))
        servers = deployment.processes[-1:] if name == "dynamo" else deployment.processes
        deployment.worker_urls = [p.url for p in deployment.processes[:-1]] if name == "dynamo" else []
        deployment.urls = [p.url for p in servers]
        deployment.admin_url = servers[0].url
        models = requests.get(deployment.admin_url + "/v1/models", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                              timeout=10)
        models.raise_for_status()
        deployment.model = models.json()["data"][0]["id"]
    except BaseException:
        deployment.stop()
        raise
    return deployment


def _complete(session: requests.Session, url: str, model: str, key: str, prompt: list[int],
              **extra) -> tuple[float, int]:
    """Stream a one-token completion; (seconds to its first token, cached prompt tokens)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    sent = time.perf_counter()
    first = None
    cached = None
    with session.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, stream=True,
                      timeout=60) as response:
        if response.status_code != 200:
            raise RuntimeError(f"probe answered {response.status_code}: {response.text[:300]}")
        for line in response.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            if first is None:
                first = time.perf_counter() - sent
            usage = json.loads(line[6:]).get("usage")
            if usage:
                cached = usage["prompt_tokens_details"]["cached_tokens"]
    if first is None or cached is None:
        raise RuntimeError("a probe's stream ended without a token or without usage")
    return first, cached


@dataclass
class Attack:
    """One attack's outcome: the attacker's first-token times and cached counts per kind, and the KS test."""

    scope: str  # "salted" (the victim's own secret) or "control" (an operator-shared prefix)
    hit_s: list[float]
    miss_s: list[float]
    hit_cached: list[int]
    miss_cached: list[int]
    victim_cached: list[int]  # the victim's own refreshes: its pages stayed cached throughout
    secret_tokens: int
    hit_workers: list[int] = field(default_factory=list)  # behind Dynamo: the worker each probe was routed to
    miss_workers: list[int] = field(default_factory=list)
    victim_worker: int | None = None  # the worker holding the victim's pages
    ks_d: float = 0.0
    ks_p: float = 1.0

    def summary(self) -> dict:
        def ms(values: list[float], q: float) -> float:
            ordered = sorted(values)
            return round(1e3 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

        return {"scope": self.scope, "probes_per_kind": len(self.hit_s), "secret_tokens": self.secret_tokens,
                "ks_d": round(self.ks_d, 4), "ks_p": self.ks_p,
                "hit_ttft_ms_p50": ms(self.hit_s, 0.5), "miss_ttft_ms_p50": ms(self.miss_s, 0.5),
                "hit_ttft_ms_p90": ms(self.hit_s, 0.9), "miss_ttft_ms_p90": ms(self.miss_s, 0.9),
                "hit_probes_with_cached_tokens": sum(c > 0 for c in self.hit_cached),
                "miss_probes_with_cached_tokens": sum(c > 0 for c in self.miss_cached),
                "victim_refreshes_hit": f"{sum(c > 0 for c in self.victim_cached[1:])}/{len(self.victim_cached) - 1}",
                **({"victim_worker_share": {"hit": self.victim_worker_share("hit"),
                                            "miss": self.victim_worker_share("miss")}} if self.hit_workers else {})}

    def victim_worker_share(self, kind: str) -> float:
        """Of the `kind` probes, the share the router sent to the worker holding the victim's pages."""
        workers = self.hit_workers if kind == "hit" else self.miss_workers
        return round(sum(w == self.victim_worker for w in workers) / len(workers), 3)


def attack(deployment: Deployment, model: Path, scope: str, num_probes: int, seed: int = 0,
           suffix_tokens: int = 16) -> Attack:
    """Run one attack (`scope`: "salted" or "control") with `num_probes` probes of each kind."""
    from runtime.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model)
    secret = tokenizer.encode(SECRET_TEXT if scope == "salted" else OPERATOR_TEXT, add_special_tokens=True)
    rng = random.Random(seed)
    question = [rng.choice(secret[1:]) for _ in range(suffix_tokens)]
    kinds = []
    for _ in range(num_probes):
        pair = ["hit", "miss"]
        rng.shuffle(pair)
        kinds += pair
    result = Attack(scope, [], [], [], [], [], len(secret))
    urls = deployment.urls
    with requests.Session() as victim, requests.Session() as attacker, requests.Session() as stats:
        def routed_to(before: list[int]) -> tuple[int, list[int]]:
            """Behind Dynamo: the worker whose prefix-cache lookups grew since `before` (asked after the timing)."""
            after = [stats.get(url + "/stats", timeout=10).json()["prefix_cache_queries"]
                     for url in deployment.worker_urls]
            grown = [i for i, (a, b) in enumerate(zip(after, before)) if a > b]
            return (grown[0] if len(grown) == 1 else -1), after

        queries: list[int] = []

        def victim_turn() -> None:  # always the first server: the victim's pages live on one replica
            nonlocal queries
            result.victim_cached.append(_complete(victim, urls[0], deployment.model, VICTIM_KEY, secret + question)[1])
            if deployment.worker_urls:
                result.victim_worker, queries = routed_to(queries)

        for i in range(8):  # warm the attacker's path (connections, the servers' first requests)
            _complete(attacker, urls[i % len(urls)], deployment.model, ATTACKER_KEY,
                      rng.sample(secret, len(secret)) + question, cache_salt=uuid.uuid4().hex)
        if deployment.worker_urls:
            queries = routed_to([0] * len(deployment.worker_urls))[1]
        victim_turn()
        started = time.monotonic()
        for i, kind in enumerate(kinds):
            if i % VICTIM_EVERY == 0:
                victim_turn()
            suffix = [rng.choice(secret[1:]) for _ in range(suffix_tokens)]
            prefix = secret if kind == "hit" else secret[:1] + rng.sample(secret[1:], len(secret) - 1)
            seconds, cached = _complete(attacker, urls[i % len(urls)], deployment.model, ATTACKER_KEY, prefix + suffix,
                                        cache_salt=uuid.uuid4().hex)  # never the attacker's own earlier pages
            (result.hit_s if kind == "hit" else result.miss_s).append(seconds)
            (result.hit_cached if kind == "hit" else result.miss_cached).append(cached)
            if deployment.worker_urls:
                worker, queries = routed_to(queries)
                (result.hit_workers if kind == "hit" else result.miss_workers).append(worker)
            if (i + 1) % 200 == 0:
                log(f"    {deployment.name} {scope}: {i + 1}/{len(kinds)} probes, {time.monotonic() - started:.0f} s")
    result.ks_d, result.ks_p = ks_2samp(result.hit_s, result.miss_s)
    return result


def index_view(deployment: Deployment, text: str) -> dict[str, dict[str, int]]:
    """The admin prefix-index lookup of `text` under each tenant's salt: {tenant: {replica: leading blocks}}."""
    views = {}
    for tenant in ("victim", "attacker"):
        response = requests.get(deployment.admin_url + "/v1/prefix-index/lookup", params={"tenant": tenant,
                                "prompt": text}, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
        response.raise_for_status()
        views[tenant] = response.json()["replicas"]
    return views


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="60 probes of each kind")
    parser.add_argument("--probes", type=int, default=500, help="probes of each kind per attack")
    parser.add_argument("--only", default=",".join(DEPLOYMENTS))
    parser.add_argument("--model", default=str(STORIES))
    args = parser.parse_args()
    num_probes = 60 if args.quick else args.probes
    model = Path(args.model)
    result = {"machine": machine_info(), "model": model.name, "probes_per_kind": num_probes, "deployments": {}}
    for name in args.only.split(","):
        log(f"side channel: {name}, {num_probes} probes of each kind per attack")
        with tempfile.TemporaryDirectory(prefix=f"side-channel-{name}-") as tmp:
            deployment = start(name, model, Path(tmp))
            try:
                row = {"salted": attack(deployment, model, "salted", num_probes).summary()}
                row["index_view_of_the_secret"] = index_view(deployment, SECRET_TEXT)  # while the victim's is cached
                row["control"] = attack(deployment, model, "control", num_probes, seed=1).summary()
            finally:
                deployment.stop()
        result["deployments"][name] = row
        for scope in ("salted", "control"):
            s = row[scope]
            log(f"  {name} {scope}: KS D={s['ks_d']} p={s['ks_p']:.3g}; first token p50 hit {s['hit_ttft_ms_p50']} ms "
                f"vs miss {s['miss_ttft_ms_p50']} ms; probes with cached tokens: hit "
                f"{s['hit_probes_with_cached_tokens']}, miss {s['miss_probes_with_cached_tokens']}; victim refreshes hit "
                f"{s['victim_refreshes_hit']}" + (f"; to the victim's worker: {s['victim_worker_share']}"
                                                  if "victim_worker_share" in s else ""))
        log(f"  {name} index view of the secret: {row['index_view_of_the_secret']}")
    write_result("side_channel", args.quick, result)


if __name__ == "__main__":
    main()

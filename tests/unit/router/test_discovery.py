"""Engines that come and go: the settings, the reconcile decision, the DNS and Kubernetes sources (fake
resolver, respx for the API), and the router app following a fake source while turns run."""

from __future__ import annotations

import asyncio
import json
import socket
import uuid
from pathlib import Path
from typing import Any

import certifi
import httpx
import pytest
import respx
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv._exceptions import ConfigError
from agentkv.server.router import RedisStore, RouterSettings, create_app
from agentkv.server.router._backend import BackendState
from agentkv.server.router._discovery import (
    Changes,
    Discovered,
    DnsSource,
    KubernetesSource,
    Member,
    backend_name,
    reconcile,
    resolve_addresses,
    slice_urls,
)
from bench._fake_vllm import StubConfig, StubState

from .conftest import FakeEngines
from .conftest import settings as router_settings

CHAT = "/v1/chat/completions"

# --- settings ------------------------------------------------------------------------------------------


def test_discovery_settings_from_the_env_names_the_chart_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    assert RouterSettings(prefill=["p:1"], decode=["d:1"]).discovery == "static"
    monkeypatch.setenv("AGENTKV_DISCOVERY", "dns")
    monkeypatch.setenv("AGENTKV_PREFILL_DNS", "agentkv-prefill.agents.svc:8100")
    monkeypatch.setenv("AGENTKV_DECODE_DNS", "agentkv-decode.agents.svc:8200")
    monkeypatch.setenv("AGENTKV_DISCOVERY_INTERVAL_S", "2.5")
    s = RouterSettings()
    assert (s.discovery, s.prefill_dns, s.decode_dns) == (
        "dns",
        "agentkv-prefill.agents.svc:8100",
        "agentkv-decode.agents.svc:8200",
    )
    assert s.discovery_interval_s == 2.5 and s.backends() == ([], [])
    for name in ("AGENTKV_PREFILL_DNS", "AGENTKV_DECODE_DNS"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AGENTKV_DISCOVERY", "kubernetes")
    monkeypatch.setenv("AGENTKV_PREFILL_SERVICE", "agentkv-prefill")
    monkeypatch.setenv("AGENTKV_DECODE_SERVICE", "agentkv-decode")
    monkeypatch.setenv("AGENTKV_DISCOVERY_NAMESPACE", "agents")
    s = RouterSettings()
    assert (s.prefill_service, s.decode_service, s.discovery_namespace) == (
        "agentkv-prefill",
        "agentkv-decode",
        "agents",
    )


DNS = {"discovery": "dns", "prefill_dns": "p.svc:8100", "decode_dns": "d.svc:8200"}
K8S = {"discovery": "kubernetes", "prefill_service": "prefill", "decode_service": "decode"}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"discovery": "dns", "prefill_dns": "p.svc:8100"}, "discovery=dns needs decode_dns"),
        ({**DNS, "decode_dns": "d.svc"}, "invalid DNS name 'd.svc': expected host:port"),
        ({**DNS, "decode_dns": "d.svc:0"}, "expected host:port"),
        ({**DNS, "decode_dns": "p.svc:8100"}, "name the same engines"),
        ({**DNS, "decode": ["http://d:1"]}, "discovery=dns finds the engines itself: leave decode empty"),
        ({**DNS, "decode_control": ["http://c:1"]}, "leave decode_control empty"),
        ({**DNS, "prefill_service": "p"}, "prefill_service is read only with discovery=kubernetes"),
        ({"discovery": "kubernetes", "decode_service": "d"}, "discovery=kubernetes needs prefill_service"),
        ({**K8S, "decode_service": "Decode"}, "invalid decode_service 'Decode'"),
        ({**K8S, "discovery_namespace": "a/b"}, "invalid discovery_namespace"),
        ({**K8S, "decode_service": "prefill"}, "name the same engines"),
        ({**K8S, "prefill_dns": "p:1"}, "prefill_dns is read only with discovery=dns"),
        ({"prefill": ["p:1"], "decode": ["d:1"], "decode_service": "d"}, "discovery is static"),
        ({"prefill": ["p:1"], "decode": ["d:1"], "discovery": "consul"}, "discovery"),
        ({**DNS, "discovery_interval_s": 0}, "discovery_interval_s"),
        ({"discovery": "static"}, "at least one --prefill URL is required"),
    ],
)
def test_discovery_setting_combinations_are_checked(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RouterSettings.build(**values)


def test_kubernetes_discovery_outside_a_pod_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ConfigError, match="KUBERNETES_SERVICE_HOST"):
        create_app(RouterSettings(**K8S))


# --- reconcile -----------------------------------------------------------------------------------------

URLS = [f"http://10.0.0.{i}:8200" for i in range(6)]


def test_reconcile_joins_drains_rejoins_and_removes() -> None:
    a, b, c, d = URLS[:4]
    members = [
        Member(url=a),  # stays
        Member(url=b),  # leaves the view: drains
        Member(url=c, draining_since=10.0, busy=False),  # drained and idle: removed
        Member(url=d, draining_since=10.0, busy=True),  # drained, busy: back in the view
    ]
    changes = reconcile(members, frozenset({a, d, URLS[4]}), now=11.0, drain_s=60.0)
    assert changes == Changes(
        join=frozenset({URLS[4]}), drain=frozenset({b}), rejoin=frozenset({d}), remove=frozenset({c})
    )


def test_reconcile_keeps_busy_drained_members_until_the_drain_bound() -> None:
    busy = [Member(url=URLS[0], draining_since=100.0, busy=True)]
    assert not reconcile(busy, frozenset(), now=159.0, drain_s=60.0)
    assert reconcile(busy, frozenset(), now=160.0, drain_s=60.0).remove == {URLS[0]}


def test_an_unknown_view_only_lets_drained_members_go() -> None:
    members = [Member(url=URLS[0]), Member(url=URLS[1], draining_since=0.0)]
    assert reconcile(members, None, now=1.0, drain_s=60.0) == Changes(remove=frozenset({URLS[1]}))


_members = st.lists(
    st.builds(
        Member,
        url=st.sampled_from(URLS),
        draining_since=st.none() | st.floats(0, 100),
        busy=st.booleans(),
    ),
    unique_by=lambda m: m.url,
)
_views = st.none() | st.frozensets(st.sampled_from(URLS))


def _applied(members: list[Member], changes: Changes, now: float) -> list[Member]:
    """The pool after a round, as `Discovery` applies it."""
    kept = []
    for m in members:
        if m.url in changes.remove:
            continue
        if m.url in changes.drain:
            m = Member(url=m.url, draining_since=now, busy=m.busy)
        elif m.url in changes.rejoin:
            m = Member(url=m.url, busy=m.busy)
        kept.append(m)
    return kept + [Member(url=url) for url in sorted(changes.join)]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(members=_members, view=_views, now=st.floats(100, 200), drain_s=st.floats(0, 200))
def test_reconcile_makes_the_serving_pool_the_view(
    members: list[Member], view: frozenset[str] | None, now: float, drain_s: float
) -> None:
    changes = reconcile(members, view, now=now, drain_s=drain_s)
    by_url = {m.url: m for m in members}
    # Removal: only drained members out of the view, busy ones only past the drain bound.
    for url in changes.remove:
        m = by_url[url]
        assert m.draining_since is not None and (view is None or url not in view)
        assert not m.busy or now - m.draining_since >= drain_s
    assert changes.join.isdisjoint(by_url)
    after = _applied(members, changes, now)
    serving = {m.url for m in after if m.draining_since is None}
    if view is None:
        assert not (changes.join or changes.drain or changes.rejoin)
        assert serving == {m.url for m in members if m.draining_since is None}
        return
    assert serving == view
    # A second round on the same view changes nothing but removals of what drained.
    again = reconcile(after, view, now=now, drain_s=drain_s)
    assert not (again.join or again.drain or again.rejoin)


def test_a_discovered_backend_is_named_by_its_address() -> None:
    assert backend_name("http://10.1.2.3:8200") == "10.1.2.3:8200"
    assert backend_name("http://[fd00::7]:8200") == "[fd00::7]:8200"


# --- DNS -----------------------------------------------------------------------------------------------


class FakeResolver:
    def __init__(self, answers: dict[str, list[str] | OSError]) -> None:
        self.answers = answers
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        answer = self.answers[host]
        if isinstance(answer, OSError):
            raise answer
        return answer


async def test_dns_source_re_resolves_every_round_and_keeps_the_view_on_errors() -> None:
    resolver = FakeResolver({"p.svc": ["10.0.0.1"], "d.svc": ["10.0.1.1", "fd00::2", "10.0.1.1"]})
    source = DnsSource(prefill="p.svc:8100", decode="d.svc:8200", resolve=resolver)
    found = await source.discover()
    assert found.prefill == {"http://10.0.0.1:8100"}
    assert found.decode == {"http://10.0.1.1:8200", "http://[fd00::2]:8200"}
    resolver.answers["d.svc"] = socket.gaierror(socket.EAI_AGAIN, "temporary failure")
    resolver.answers["p.svc"] = []
    assert await source.discover() == Discovered(prefill=frozenset(), decode=None)
    assert resolver.asked == [("p.svc", 8100), ("d.svc", 8200)] * 2


async def test_the_system_resolver_answers_no_records_with_an_empty_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert "127.0.0.1" in await resolve_addresses("localhost", 8200)
    loop = asyncio.get_running_loop()
    errors = iter(
        [socket.gaierror(socket.EAI_NONAME, "no such name"), socket.gaierror(socket.EAI_AGAIN, "x")]
    )

    async def failing(*args: Any, **kwargs: Any) -> Any:
        raise next(errors)

    monkeypatch.setattr(loop, "getaddrinfo", failing)
    assert await resolve_addresses("gone.svc", 8200) == []
    with pytest.raises(OSError):
        await resolve_addresses("flaky.svc", 8200)


# --- Kubernetes ----------------------------------------------------------------------------------------

API = "https://k8s.test:6443"
SLICES = f"{API}/apis/discovery.k8s.io/v1/namespaces/agents/endpointslices"
SELECTOR = "kubernetes.io/service-name in (agentkv-prefill,agentkv-decode)"


def endpoint_slice(
    service: str,
    addresses: list[str],
    *,
    ports: list[dict[str, Any]] | None = None,
    ready: dict[str, bool | None] | None = None,
) -> dict[str, Any]:
    """One EndpointSlice of `service`; an address in `ready` gets that condition, the others none."""
    ready = ready or {}
    return {
        "metadata": {"name": f"{service}-x", "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv6" if ":" in addresses[0] else "IPv4",
        "ports": [{"name": "http", "port": 8200, "protocol": "TCP"}] if ports is None else ports,
        "endpoints": [
            {"addresses": [a], "conditions": {"ready": ready[a]} if a in ready else {}} for a in addresses
        ],
    }


def test_slice_urls_take_ready_endpoints_on_the_http_port() -> None:
    item = endpoint_slice(
        "agentkv-decode",
        ["10.0.0.1", "10.0.0.2", "10.0.0.3"],
        ports=[{"name": "metrics", "port": 9000}, {"name": "http", "port": 8200}],
        ready={"10.0.0.2": False, "10.0.0.3": None},
    )
    assert slice_urls(item) == ("agentkv-decode", frozenset({"http://10.0.0.1:8200", "http://10.0.0.3:8200"}))
    first_port = endpoint_slice("s", ["fd00::1"], ports=[{"name": "api", "port": 8100}, {"port": 8200}])
    assert slice_urls(first_port) == ("s", frozenset({"http://[fd00::1]:8100"}))
    assert slice_urls(endpoint_slice("s", ["10.0.0.1"], ports=[])) == ("s", frozenset())


def kubernetes_source(token: str | None = "tok-1") -> KubernetesSource:
    return KubernetesSource(
        api_url=API,
        namespace="agents",
        prefill_service="agentkv-prefill",
        decode_service="agentkv-decode",
        client=httpx.AsyncClient(),
        token=lambda: token,
    )


@respx.mock
async def test_kubernetes_source_lists_both_services_page_by_page() -> None:
    pages = [
        {
            "metadata": {"continue": "page-2"},
            "items": [
                endpoint_slice("agentkv-prefill", ["10.0.0.1"], ports=[{"name": "http", "port": 8100}])
            ],
        },
        {
            "metadata": {"resourceVersion": "41"},
            "items": [
                endpoint_slice("agentkv-decode", ["10.0.1.1", "10.0.1.2"], ready={"10.0.1.2": False}),
                endpoint_slice("agentkv-decode", ["10.0.1.3"]),
                endpoint_slice("unrelated", ["10.0.9.9"]),
            ],
        },
    ]
    route = respx.get(SLICES).mock(side_effect=[httpx.Response(200, json=page) for page in pages])
    source = kubernetes_source()
    found = await source.discover()
    assert found.prefill == {"http://10.0.0.1:8100"}
    assert found.decode == {"http://10.0.1.1:8200", "http://10.0.1.3:8200"}
    first, second = (call.request for call in route.calls)
    assert first.url.params["labelSelector"] == SELECTOR and "continue" not in first.url.params
    assert second.url.params["continue"] == "page-2"
    assert first.headers["authorization"] == "Bearer tok-1"
    await source.aclose()


@respx.mock
async def test_kubernetes_source_keeps_the_view_when_the_api_fails() -> None:
    respx.get(SLICES).mock(
        side_effect=[httpx.Response(403, json={"kind": "Status"}), httpx.ConnectError("refused")]
    )
    source = kubernetes_source()
    assert await source.discover() == Discovered(prefill=None, decode=None)
    assert await source.discover() == Discovered(prefill=None, decode=None)


@respx.mock
async def test_kubernetes_watch_ends_the_wait_at_the_first_change() -> None:
    watches: list[httpx.Request] = []
    events = [
        [{"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "57"}}}],
        [
            {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "58"}}},
            {"type": "MODIFIED", "object": endpoint_slice("agentkv-decode", ["10.0.1.4"])},
        ],
    ]

    def api(request: httpx.Request) -> httpx.Response:
        if request.url.params.get("watch") != "true":
            return httpx.Response(200, json={"metadata": {"resourceVersion": "41"}, "items": []})
        watches.append(request)
        lines = b"".join(json.dumps(e).encode() + b"\n" for e in events[len(watches) - 1])
        return httpx.Response(200, content=lines)

    respx.get(SLICES).mock(side_effect=api)
    source = kubernetes_source()
    await source.wait(0.01)  # before any list: no version to watch from, a plain wait
    assert not watches
    await source.discover()
    await source.wait(0.01)  # a bookmark, then the watch ends without a change
    await source.wait(30.0)  # a change: back at once (the watch's own timeout is the interval)
    assert [w.url.params["resourceVersion"] for w in watches] == ["41", "57"]
    assert watches[1].url.params["timeoutSeconds"] == "30"
    assert watches[0].url.params["labelSelector"] == SELECTOR


def test_in_cluster_reads_the_service_account(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ca.crt").write_bytes(Path(certifi.where()).read_bytes())
    (tmp_path / "namespace").write_text("agents\n")
    (tmp_path / "token").write_text("tok-2\n")
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    source = KubernetesSource.in_cluster(
        prefill_service="agentkv-prefill", decode_service="agentkv-decode", account=tmp_path, environ=env
    )
    assert source._url == "https://10.96.0.1:443/apis/discovery.k8s.io/v1/namespaces/agents/endpointslices"
    assert source._headers() == {"authorization": "Bearer tok-2"}
    (tmp_path / "token").write_text("tok-3\n")  # the kubelet rotated it
    assert source._headers() == {"authorization": "Bearer tok-3"}
    other = KubernetesSource.in_cluster(
        prefill_service="p", decode_service="d", namespace="elsewhere", account=tmp_path, environ=env
    )
    assert "/namespaces/elsewhere/" in other._url
    with pytest.raises(ConfigError, match="service account"):
        KubernetesSource.in_cluster(
            prefill_service="p", decode_service="d", account=tmp_path / "missing", environ=env
        )


# --- the router following a source ---------------------------------------------------------------------

P0, P1 = "http://p0.test:8100", "http://p1.test:8100"
D0, D1, D2 = "http://d0.test:8200", "http://d1.test:8200", "http://d2.test:8200"


class FakeSource:
    """What discovery would see; tests move engines in and out between rounds."""

    def __init__(self, *, prefill: set[str], decode: set[str]) -> None:
        self.prefill, self.decode = prefill, decode
        self.failing = False
        self.rounds = 0
        self.discovered = asyncio.Event()
        self.closed = False

    async def discover(self) -> Discovered:
        self.rounds += 1
        self.discovered.set()
        if self.failing:
            return Discovered(prefill=None, decode=None)
        return Discovered(prefill=frozenset(self.prefill), decode=frozenset(self.decode))

    async def wait(self, interval_s: float) -> None:
        await asyncio.Event().wait()  # the tests run the rounds themselves

    async def aclose(self) -> None:
        self.closed = True


def add_engine(engines: FakeEngines, host: str) -> None:
    """Another fake engine (the conftest's four are p0, p1, d0, d1)."""
    role = "prefill" if host.startswith("p") else "decode"
    engines.engine_id[host] = f"{host}-ENGINE"
    engines.engines[host] = StubState(config=StubConfig(role=role, model="tiny"))
    if role == "decode":
        engines.retention.add(host)


def discovering(
    engines: FakeEngines, source: FakeSource, *, store: Any = None, **overrides: Any
) -> httpx.AsyncClient:
    values = {"prefill": [], "decode": [], **DNS, **overrides}
    app = create_app(
        router_settings(**values),
        transport=httpx.MockTransport(engines.handle),
        store=store,
        discovery=source,
    )
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router.test")
    client.app = app  # type: ignore[attr-defined]
    return client


def router_of(client: httpx.AsyncClient) -> Any:
    return client.app.state.router  # type: ignore[attr-defined]


class Agent:
    """One conversation: its history grows by the answer and a tool result each turn."""

    def __init__(self, client: httpx.AsyncClient, cid: str) -> None:
        self.client, self.cid = client, cid
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": f"task {cid}"}]
        self.reuse: list[str] = []

    async def turn(self, *, stream: bool = False, via: httpx.AsyncClient | None = None) -> httpx.Response:
        body = {"model": "tiny", "messages": self.messages, "stream": stream}
        r = await (via or self.client).post(CHAT, json=body, headers={"x-session-id": self.cid})
        assert r.status_code == 200, r.text
        self.reuse.append(r.headers["x-agentkv-reuse"])
        # A stream's answer is the fake decode's default reply.
        answer = {"role": "assistant", "content": "sure, done."}
        self.messages += [
            answer if stream else r.json()["choices"][0]["message"],
            {"role": "user", "content": f"tool result {len(self.messages)}"},
        ]
        return r

    async def decode(self, via: httpx.AsyncClient | None = None) -> str:
        return str((await (via or self.client).get(f"/v1/conversations/{self.cid}")).json()["decode"])


def names(pool: Any) -> dict[str, BackendState]:
    return {s.name: s for s in pool}


async def test_engines_join_after_their_health_check(engines: FakeEngines) -> None:
    source = FakeSource(prefill={P0}, decode={D0})
    engines.down.add("d0.test")
    async with discovering(engines, source) as client:
        router = router_of(client)
        await router.discovery.step()
        d0 = names(router.decode)["d0.test:8200"]
        assert d0.backend.control_url == "http://d0.test:9200"  # the static rule: port + 1000
        assert not d0.healthy  # refused its probe: in the pool, out of rotation
        r = await client.post(CHAT, json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and (await client.get("/health")).status_code == 503
        engines.down.clear()
        await router.discovery.step()  # probed again while joining
        assert d0.healthy and d0.retention is True
        assert (await client.get("/health")).json() == {"status": "ok", "prefill": 1, "decode": 1}
        await Agent(client, "a").turn()


async def test_decodes_join_and_leave_under_load_without_a_failed_turn(engines: FakeEngines) -> None:
    add_engine(engines, "d2.test")
    source = FakeSource(prefill={P0}, decode={D0, D1})
    async with discovering(engines, source) as client:
        router = router_of(client)
        await router.discovery.step()
        agents = [Agent(client, f"c{i}") for i in range(6)]
        await asyncio.gather(*(a.turn() for a in agents))
        await asyncio.gather(*(a.turn() for a in agents))
        assert all(a.reuse == ["miss", "hit"] for a in agents)

        # d2 appears: the next conversation lands on it (nothing placed there yet).
        source.decode.add(D2)
        await router.discovery.step()
        assert names(router.decode)["d2.test:8200"].healthy
        late = Agent(client, "late")
        await late.turn()
        assert await late.decode() == "d2.test:8200"
        agents.append(late)

        # d0 goes while a turn streams on every conversation: it drains, those turns finish there.
        on_d0 = {a.cid for a in agents if await a.decode() == "d0.test:8200"}
        assert on_d0
        engines.stream_gate = asyncio.Event()
        before = len(engines.completions("d"))
        running = [asyncio.create_task(a.turn(stream=True)) for a in agents]
        while len(engines.completions("d")) < before + len(agents):
            await asyncio.sleep(0)
        source.decode.discard(D0)
        await router.discovery.step()
        d0 = names(router.decode)["d0.test:8200"]
        assert d0.draining and not d0.healthy and d0.outstanding == len(on_d0)
        await router.health.check_once()  # a health round leaves a draining decode out of rotation
        await router.discovery.step()
        assert not d0.healthy and "d0.test:8200" in names(router.decode)  # busy: not removed yet
        engines.stream_gate.set()
        await asyncio.gather(*running)
        served_by_d0 = len(engines.completions("d0"))

        # Idle now: it leaves the pool; its conversations recompute elsewhere, the others keep reusing.
        await router.discovery.step()
        assert "d0.test:8200" not in names(router.decode)
        await asyncio.gather(*(a.turn() for a in agents))
        for a in agents:
            assert a.reuse[-2] == "hit"  # the streamed turn, on the decode it started on
            assert a.reuse[-1] == ("miss" if a.cid in on_d0 else "hit"), a.cid
            assert await a.decode() != "d0.test:8200"
        await asyncio.gather(*(a.turn() for a in agents))
        assert all(a.reuse[-1] == "hit" for a in agents)
    assert len(engines.completions("d0")) == served_by_d0


async def test_a_prefill_that_leaves_takes_no_new_turns(engines: FakeEngines) -> None:
    source = FakeSource(prefill={P0}, decode={D0})
    async with discovering(engines, source) as client:
        router = router_of(client)
        await router.discovery.step()
        agent = Agent(client, "a")
        await agent.turn()
        source.prefill = {P1}
        await router.discovery.step()  # p1 joins, p0 drains
        await agent.turn()
        await router.discovery.step()  # p0 idle: gone
        await agent.turn()
        assert agent.reuse == ["miss", "hit", "hit"]  # the pull reads decode's blocks from any prefill
        assert set(names(router.prefill)) == {"p1.test:8100"}
    assert len(engines.completions("p0")) == 1 and len(engines.completions("p1")) == 2


async def test_an_engine_back_in_view_while_draining_rejoins_health_check_first(
    engines: FakeEngines,
) -> None:
    source = FakeSource(prefill={P0}, decode={D0, D1})
    async with discovering(engines, source) as client:
        router = router_of(client)
        await router.discovery.step()
        d1 = names(router.decode)["d1.test:8200"]
        d1.outstanding = 1  # a turn still runs there
        source.decode = {D0}
        await router.discovery.step()
        assert d1.draining
        source.decode = {D0, D1}
        engines.down.add("d1.test")  # it restarted and is not up yet
        await router.discovery.step()
        assert not d1.draining and not d1.healthy
        engines.down.clear()
        await router.discovery.step()
        assert d1.healthy and names(router.decode)["d1.test:8200"] is d1


async def test_an_unknown_view_drains_nothing(engines: FakeEngines) -> None:
    source = FakeSource(prefill={P0}, decode={D0})
    async with discovering(engines, source) as client:
        router = router_of(client)
        await router.discovery.step()
        source.failing = True
        await router.discovery.step()
        assert [s.healthy for s in (*router.prefill, *router.decode)] == [True, True]
        await Agent(client, "a").turn()


async def test_the_app_runs_discovery_for_its_lifetime(engines: FakeEngines) -> None:
    source = FakeSource(prefill={P0}, decode={D0})
    app = create_app(
        router_settings(prefill=[], decode=[], **DNS),
        transport=httpx.MockTransport(engines.handle),
        discovery=source,
    )
    async with app.router.lifespan_context(app):
        await asyncio.wait_for(source.discovered.wait(), timeout=10)
    assert source.rounds >= 1 and source.closed


async def test_router_replicas_on_redis_each_follow_their_own_view(
    engines: FakeEngines, redis_url: str
) -> None:
    """Records name decodes by address, so a conversation moved off a drained decode by one replica is
    found on its new decode by the other, which never routes it back to the old one."""
    prefix = f"test-{uuid.uuid4().hex}:"
    seen_a = FakeSource(prefill={P0}, decode={D0, D1})
    seen_b = FakeSource(prefill={P0}, decode={D0, D1})
    a = discovering(engines, seen_a, store=RedisStore(url=redis_url, prefix=prefix))
    b = discovering(engines, seen_b, store=RedisStore(url=redis_url, prefix=prefix))
    async with a, b:
        await router_of(a).discovery.step()
        await router_of(b).discovery.step()
        agents = [Agent(a, f"c{i}") for i in range(4)]
        await asyncio.gather(*(x.turn() for x in agents))
        on_d0 = {x.cid for x in agents if await x.decode() == "d0.test:8200"}
        assert on_d0 and len(on_d0) < len(agents)

        seen_a.decode = {D1}  # replica A sees d0 go first; B still does not
        await router_of(a).discovery.step()
        await router_of(a).discovery.step()
        assert "d0.test:8200" not in names(router_of(a).decode)
        served_by_d0 = len(engines.completions("d0"))
        await asyncio.gather(*(x.turn() for x in agents))  # through A
        await asyncio.gather(*(x.turn(via=b) for x in agents))  # through B, whose view still has d0
        for x in agents:
            assert x.reuse[1:] == ["miss" if x.cid in on_d0 else "hit", "hit"], x.cid
            assert await x.decode(via=b) == "d1.test:8200"
        assert len(engines.completions("d0")) == served_by_d0

        seen_b.decode = {D1}
        await router_of(b).discovery.step()
        await asyncio.gather(*(x.turn(via=b) for x in agents))
        assert all(x.reuse[-1] == "hit" for x in agents)
    assert len(engines.completions("d0")) == served_by_d0

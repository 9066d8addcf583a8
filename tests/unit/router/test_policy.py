"""Routing and path decisions (pure functions, no I/O)."""

from __future__ import annotations

import math
import time

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from agentkv.server.router import Backend, CostModel, choose_path
from agentkv.server.router._backend import BackendPool, Registration
from agentkv.server.router._policy import Line, assess_reuse, choose_decode, choose_prefill
from agentkv.server.router._prefix import Prefix


def pool(role: str, loads: list[int], healthy: list[bool] | None = None) -> BackendPool:
    backends = [Backend(name=f"{role[0]}{i}", role=role, url=f"http://h{i}:1") for i in range(len(loads))]  # type: ignore[arg-type]
    p = BackendPool(backends=backends)
    for state, load, ok in zip(p, loads, healthy or [True] * len(loads), strict=True):
        state.outstanding, state.healthy = load, ok
    return p


def test_prefill_least_outstanding_healthy_first_configured_on_ties() -> None:
    assert choose_prefill(pool("prefill", [3, 1, 1])).name == "p1"  # type: ignore[union-attr]
    assert choose_prefill(pool("prefill", [3, 1, 0], [True, True, False])).name == "p1"  # type: ignore[union-attr]
    assert choose_prefill(pool("prefill", [0], [False])) is None
    assert choose_prefill(pool("prefill", [0, 5]), exclude=frozenset({"p0"})).name == "p1"  # type: ignore[union-attr]


def test_prefill_ties_go_to_the_one_that_computed_the_conversation() -> None:
    assert choose_prefill(pool("prefill", [1, 1, 1]), prefer="p2").name == "p2"  # type: ignore[union-attr]
    assert choose_prefill(pool("prefill", [1, 0, 1]), prefer="p2").name == "p1"  # type: ignore[union-attr]
    assert choose_prefill(pool("prefill", [0, 0], [True, False]), prefer="p1").name == "p0"  # type: ignore[union-attr]
    assert choose_prefill(pool("prefill", [0, 0]), prefer="p1", exclude=frozenset({"p1"})).name == "p0"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("loads", "healthy", "cap", "expected"),
    [
        ([5, 0], [True, True], 8, "d0"),  # sticky even when busier
        ([8, 0], [True, True], 8, "d1"),  # over the cap: least loaded instead
        ([0, 3], [False, True], 8, "d1"),  # sticky unhealthy
        ([4, 2, 3], [True, True, True], 4, "d1"),
    ],
)
def test_decode_sticky_with_load_cap(loads: list[int], healthy: list[bool], cap: int, expected: str) -> None:
    assert choose_decode(pool("decode", loads, healthy), sticky="d0", load_cap=cap).name == expected  # type: ignore[union-attr]


def test_decode_without_history_is_least_loaded() -> None:
    assert choose_decode(pool("decode", [2, 1]), sticky=None, load_cap=8).name == "d1"  # type: ignore[union-attr]


BODY = {
    "messages": [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
}
PREFIX = Prefix.of_turn(
    {"messages": BODY["messages"][:1]}, {"role": "assistant", "content": "b", "tool_calls": []}
)
RETAINED = {"remote_block_ids": [[1]], "remote_engine_id": "E", "remote_num_tokens": 9}


def assess(**overrides: object) -> str:
    decode = next(iter(pool("decode", [0])))
    decode.registration = overrides.pop("registration", None)  # type: ignore[assignment]
    args: dict = dict(
        retained=RETAINED,
        expires_at=time.time() + 60,
        prefix=PREFIX,
        body=BODY,
        decode=decode,
        now=time.time(),
        margin_s=6.0,
    )
    args.update(overrides)
    return assess_reuse(**args)


def test_assess_reuse() -> None:
    assert assess() == "ok"
    assert assess(retained=None) == "miss"
    assert assess(expires_at=time.time() + 5) == "expired"  # inside the safety margin
    assert assess(expires_at=None) == "expired"
    assert assess(registration=Registration(engine_id="E")) == "ok"
    assert assess(registration=Registration(engine_id="OTHER")) == "expired"
    assert (
        assess(
            retained={**RETAINED, "remote_registration_generation": 1},
            registration=Registration(engine_id="E", generation=2),
        )
        == "expired"
    )
    assert (
        assess(
            body={
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "B"},
                    {"role": "user", "content": "c"},
                ]
            }
        )
        == "mismatch"
    )
    assert assess(body={"messages": BODY["messages"][:2]}) == "mismatch"  # nothing new after the prefix
    # Exact mode pulls only what our connector offers (prefill-computed KV, fingerprinted); a stock decode's
    # offer ends with KV it computed itself.
    assert assess(exact=True) == "miss"
    assert assess(exact=True, retained={**RETAINED, "agentkv_block_hashes": ["h0"]}) == "ok"


def trained(pd: tuple[float, float], local: tuple[float, float]) -> CostModel:
    """A model fed exact samples of two lines ms = fixed + rate * tokens."""
    model = CostModel()
    for n in (10, 100, 400, 50):
        model.pd.observe(n, pd[0] + pd[1] * n)
        model.local.observe(n, local[0] + local[1] * n)
    return model


def test_line_recovers_fixed_and_rate() -> None:
    line = Line()
    assert line.predict(5) is None
    for n in (10, 200, 50, 400):
        line.observe(n, 30 + 0.5 * n)
    assert line.predict(1000) == pytest.approx(530, rel=1e-6)
    single = Line()
    single.observe(100, 50)
    assert single.predict(200) == pytest.approx(100)


def plane(tokens: float, context: float) -> float:
    return 20 + 0.3 * tokens + 0.001 * context


def test_line_recovers_a_plane_over_tokens_and_context() -> None:
    line = Line()
    assert line.predict(5, context=1_000) is None
    for n, c in ((100, 30_000), (500, 30_000), (100, 120_000), (800, 60_000), (300, 200_000), (50, 90_000)):
        line.observe(n, plane(n, c), context=c)
    for n, c in ((512, 127_000), (2_000, 10_000), (1, 0), (10_000, 500_000)):
        assert line.predict(n, context=c) == pytest.approx(plane(n, c), rel=1e-6)


def one_feature(samples: list[tuple[float, float]], tokens: float, alpha: float = 0.2) -> float:
    """The fit a line made before it learned the context: raw moments of tokens alone."""
    x = y = xx = xy = 0.0
    for i, (n, ms) in enumerate(samples):
        a = alpha if i else 1.0
        x, y, xx, xy = x + a * (n - x), y + a * (ms - y), xx + a * (n * n - xx), xy + a * (n * ms - xy)
    var = xx - x * x
    if var <= 1e-9 * max(xx, 1.0):
        return y / x * tokens if x > 0 else y
    rate = max((xy - x * y) / var, 0.0)
    return max(y - rate * x, 0.0) + rate * tokens


@pytest.mark.parametrize(
    "samples",
    [
        [(10, 35.0), (200, 130.0), (50, 52.0), (400, 233.0), (120, 90.0)],
        [(497, 94.0), (497, 113.0), (497, 178.0)],  # one size: all of it per token
        [(10, 80.0), (200, 40.0), (400, 10.0)],  # faster when longer: noise, no rate
        [(0, 12.0), (0, 15.0)],
    ],
)
def test_a_line_at_one_context_fits_tokens_alone(samples: list[tuple[float, float]]) -> None:
    """Turns that all share one context cannot tell its cost from the fixed one: the line is the fit on
    tokens alone, whatever context it is asked about."""
    line = Line()
    for n, ms in samples:
        line.observe(n, ms, context=126_981)
    for n in (0, 1, 64, 497, 5_000):
        expected = one_feature(samples, n)
        for c in (0, 33_000, 126_981, 1_000_000):
            assert line.predict(n, context=c) == pytest.approx(expected, rel=1e-9, abs=1e-9)


# fixed ms, ms per computed token, ms per context token
_coefficients = st.tuples(st.floats(0, 200), st.floats(0, 1), st.floats(0, 0.01))
_points = st.lists(st.tuples(st.integers(1, 8_192), st.integers(0, 300_000)), min_size=3, max_size=24)


def spread(values: list[int]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)) / max(mean, 1.0)


def correlation(points: list[tuple[int, int]]) -> float:
    n = len(points)
    mx, mc = sum(x for x, _ in points) / n, sum(c for _, c in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    scc = sum((c - mc) ** 2 for _, c in points)
    sxc = sum((x - mx) * (c - mc) for x, c in points)
    return abs(sxc) / math.sqrt(sxx * scc)


@settings(deadline=None)
@given(plane=_coefficients, points=_points, at=st.tuples(st.integers(0, 8_192), st.integers(0, 300_000)))
def test_a_line_recovers_any_plane_it_sees_from_enough_points(
    plane: tuple[float, float, float], points: list[tuple[int, int]], at: tuple[int, int]
) -> None:
    """Exact samples of a plane at points that tell its three terms apart (several tokens and contexts, not
    on one line) give back the plane, anywhere."""
    tokens, contexts = [x for x, _ in points], [c for _, c in points]
    assume(len(set(tokens)) >= 3 and len(set(contexts)) >= 3)
    assume(spread(tokens) > 1e-3 and spread(contexts) > 1e-3 and correlation(points) < 0.99)
    fixed, rate, context_rate = plane
    line = Line()
    for x, c in points:
        line.observe(x, fixed + rate * x + context_rate * c, context=c)
    x, c = at
    assert line.predict(x, context=c) == pytest.approx(
        fixed + rate * x + context_rate * c, rel=1e-6, abs=1e-6
    )


_finite = st.floats(0, 1e6, allow_nan=False, allow_infinity=False)


@settings(deadline=None)
@given(
    samples=st.lists(st.tuples(_finite, _finite, _finite), min_size=1, max_size=24),
    tokens=st.tuples(_finite, _finite),
    context=st.tuples(_finite, _finite),
)
def test_a_line_never_predicts_a_negative_cost_or_a_cheaper_longer_turn(
    samples: list[tuple[float, float, float]], tokens: tuple[float, float], context: tuple[float, float]
) -> None:
    """Whatever it saw, a line's rates are non-negative: a turn costs something, and more so when longer."""
    line = Line()
    for n, c, ms in samples:
        line.observe(n, ms, context=c)
    (n0, n1), (c0, c1) = sorted(tokens), sorted(context)
    low, high = line.predict(n0, context=c0), line.predict(n1, context=c1)
    assert low is not None and high is not None
    assert math.isfinite(low) and math.isfinite(high)
    assert 0 <= low <= high


def test_a_line_ignores_samples_that_say_nothing() -> None:
    line = Line()
    for n, ms, c in (
        (-1, 10.0, 0.0),
        (10, -1.0, 0.0),
        (10, math.nan, 0.0),
        (10, 5.0, -3.0),
        (math.inf, 5.0, 0.0),
    ):
        line.observe(n, ms, context=c)
    assert line.samples == 0 and line.predict(10) is None


def decide(
    model: CostModel,
    *,
    n: int,
    load: int = 0,
    policy: str = "auto",
    ok: bool = True,
    cap: int = 512,
    exact: bool = False,
    prefill_load: int = 0,
    queue_cap: int = 0,
    context: int = 0,
):
    return choose_path(
        policy=policy,
        reuse_ok=ok,
        new_tokens=n,
        decode_outstanding=load,
        local_max_tokens=cap,
        model=model,
        exact=exact,
        prefill_outstanding=prefill_load,
        prefill_queue_cap=queue_cap,
        context_tokens=context,
    )


def test_path_choice() -> None:
    # P/D costs a fixed hop (40 ms) but prefills at 0.1 ms/token; decode-local has no hop but 0.3 ms/token.
    model = trained(pd=(40, 0.1), local=(0, 0.3))
    assert decide(model, n=50).path == "decode-local"  # 15 ms < 45 ms
    assert decide(model, n=400).path == "pull"  # 120 ms > 80 ms
    assert decide(model, n=50, load=3).path == "pull"  # a busy decode: 60 ms > 45 ms
    assert decide(model, n=50, cap=10).path == "pull"  # over the local cap whatever the costs
    assert decide(model, n=50, ok=False).path == "recompute"
    assert decide(model, n=50, policy="always-pd").path == "pull"
    assert decide(model, n=400, policy="always-local").path == "decode-local"
    # Exact mode: never local, however cheap, since decode would reuse its own KV.
    assert decide(model, n=50, exact=True).path == "pull"
    assert decide(CostModel(), n=50, exact=True).path == "pull"


def test_a_saturated_prefill_sends_every_turn_to_decode() -> None:
    """Conditional disaggregation: at the queue cap a turn is prefilled on decode whatever its length or the
    lines say, a cold one (no reusable blocks) included; below it, or in exact mode, nothing changes."""
    model = trained(pd=(40, 0.1), local=(0, 0.3))
    busy = decide(model, n=16_000, ok=False, prefill_load=4, queue_cap=4)
    assert (busy.path, busy.prefill_busy) == ("decode-local", True)
    assert decide(model, n=400, load=8, prefill_load=5, queue_cap=4).path == "decode-local"  # over the cap
    assert decide(model, n=16_000, ok=False, prefill_load=3, queue_cap=4).path == "recompute"
    assert decide(model, n=400, prefill_load=3, queue_cap=4).path == "pull"
    assert decide(model, n=16_000, ok=False, prefill_load=99, queue_cap=0).path == "recompute"  # 0: off
    assert decide(model, n=400, prefill_load=9, queue_cap=4, exact=True).path == "pull"
    assert decide(model, n=400, ok=False, prefill_load=9, queue_cap=4, exact=True).path == "recompute"
    assert decide(model, n=400, prefill_load=9, queue_cap=4, policy="always-pd").path == "pull"
    assert not decide(model, n=50).prefill_busy


def test_always_local_prefills_cold_turns_on_decode_too() -> None:
    model = trained(pd=(40, 0.1), local=(0, 0.3))
    assert decide(model, n=16_000, ok=False, policy="always-local").path == "decode-local"
    assert decide(model, n=16_000, ok=False, policy="always-pd").path == "recompute"


def test_path_choice_before_costs_are_measured() -> None:
    assert decide(CostModel(), n=50).path == "decode-local"
    assert decide(CostModel(), n=50, load=1).path == "pull"


def test_a_recompute_teaches_neither_line() -> None:
    """Cold turns (the whole prompt computed on P) must not price a short pull: at long contexts their
    line predicts a 512-token pull at the cost of computing 512 tokens, far below what the pull costs."""
    model = CostModel()
    for prompt, ms in ((32_773, 1_480.0), (65_541, 3_830.0), (98_309, 7_221.0), (126_981, 11_169.0)):
        model.observe_turn(path="recompute", computed_tokens=prompt, reused_tokens=0, ttft_ms=ms)
        # A cold turn prefilled on a busy decode, and a pull prefill declined: the whole prompt computed too.
        model.observe_turn(path="decode-local", computed_tokens=prompt, reused_tokens=0, ttft_ms=ms)
        model.observe_turn(path="pull", computed_tokens=prompt, reused_tokens=0, ttft_ms=ms)
    for ms in (94.0, 113.0, 178.0):
        model.observe_turn(path="decode-local", computed_tokens=497, reused_tokens=126_981, ttft_ms=ms)
    assert model.pd.samples == 0 and model.local.samples == 3
    # The H200's figures: with the cold turns on the P/D line this turn was pulled (331 ms) although
    # decode-local took 212 ms at the same length; an idle decode keeps it local until pulls are measured.
    assert decide(model, n=497).path == "decode-local"
    for ms in (331.0, 300.0, 350.0):
        model.observe_turn(path="pull", computed_tokens=497, reused_tokens=126_981, ttft_ms=ms)
    assert model.pd.samples == 3
    assert decide(model, n=497).path == "decode-local"  # ~128 ms < ~327 ms
    assert decide(model, n=497, load=3).path == "pull"  # a busy decode: ~514 ms > ~327 ms


def test_the_context_prices_turns_apart() -> None:
    """A 512-token tool result on the H200 took 97 ms decode-local at 33k tokens of context and 180 ms at
    127k, and 331 ms pulled at 127k; a pull's cost grows faster with the context (prefill's per-request work
    over every id and its read of decode's KV come on top of decode's). With the pull at 33k put at 210 ms,
    lines learned on both contexts price each turn at its own: a decode with one stream running (decode-local
    priced at twice its line) keeps the short-context turn and loses the long-context one to the pull. Lines
    blind to the context price both turns alike."""
    model, blind = CostModel(), CostModel()
    for c in (33_000, 127_000):
        for n in (256, 512, 1_024):
            local = 97 + 0.06 * (n - 512) + (180 - 97) / 94_000 * (c - 33_000)
            pull = 210 + 0.03 * (n - 512) + (331 - 210) / 94_000 * (c - 33_000)
            model.observe_turn(path="decode-local", computed_tokens=n, reused_tokens=c, ttft_ms=local)
            model.observe_turn(path="pull", computed_tokens=n, reused_tokens=c, ttft_ms=pull)
            blind.local.observe(n, local)
            blind.pd.observe(n, pull)
    for line, short, long in ((model.local, 97, 180), (model.pd, 210, 331)):
        assert line.predict(512, context=33_000) == pytest.approx(short)
        assert line.predict(512, context=127_000) == pytest.approx(long)
    for c in (33_000, 127_000):
        assert decide(model, n=512, context=c).path == "decode-local"  # an idle decode
    assert decide(model, n=512, load=1, context=33_000).path == "decode-local"  # 194 < 210 ms
    assert decide(model, n=512, load=1, context=127_000).path == "pull"  # 360 > 331 ms
    paths = {decide(blind, n=512, load=1, context=c).path for c in (33_000, 127_000)}
    assert len(paths) == 1


def test_chars_per_token_is_learned() -> None:
    model = CostModel()
    model.observe_chars(3000, 1000)
    assert model.estimate_tokens(300) == 100


def test_idle_backends_take_turns_for_new_conversations() -> None:
    decodes = pool("decode", [0, 0])
    picks = [choose_decode(decodes, sticky=None, load_cap=8) for _ in range(4)]
    assert [p.name for p in picks if p] == ["d0", "d1", "d0", "d1"]
    # Stickiness still wins over the spread.
    assert (s := choose_decode(decodes, sticky="d1", load_cap=8)) is not None and s.name == "d1"


def test_a_higher_registration_generation_means_older_retained_blocks_are_gone() -> None:
    # vLLM >= 0.33: decode re-registered its KV (e.g. woke from sleep) and counts it in its params.
    older = {**RETAINED, "remote_registration_generation": 1}
    newer = {**RETAINED, "remote_registration_generation": 3}
    assert assess(retained=older, registration=Registration(engine_id="E", generation=2)) == "expired"
    assert assess(retained=older, registration=Registration(engine_id="E", generation=1)) == "ok"
    # A record newer than the router's last sighting: the re-registration was not seen yet, the blocks are.
    assert assess(retained=newer, registration=Registration(engine_id="E", generation=2)) == "ok"
    assert assess(retained=RETAINED, registration=Registration(engine_id="E", generation=2)) == "ok"  # < 0.33


def test_a_late_answer_of_an_older_generation_does_not_roll_the_decode_back() -> None:
    decode = next(iter(pool("decode", [0])))
    decode.saw_registration(Registration(engine_id="E", generation=2))
    decode.saw_registration(Registration(engine_id="E", generation=1))  # a turn that started before the wake
    assert decode.registration == Registration(engine_id="E", generation=2)
    decode.saw_registration(Registration(engine_id="E", generation=3))
    assert decode.registration == Registration(engine_id="E", generation=3)
    decode.saw_registration(Registration(engine_id="RESTARTED", generation=1))  # a new engine starts over
    assert decode.registration == Registration(engine_id="RESTARTED", generation=1)
    decode.saw_registration(Registration(engine_id=None, generation=9))  # says nothing about which engine
    assert decode.registration == Registration(engine_id="RESTARTED", generation=1)

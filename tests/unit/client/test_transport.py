import httpx
import pytest
import respx

from agentkv import APIStatusError, ConfigError, ConnectError
from agentkv.client import ControlClient, Deadline, Timeouts, first_model, turn_headers

BASE = "http://router.test/v1"


def test_turn_headers() -> None:
    headers = turn_headers("c1", session_header="x-smg-routing-key", request_id="r1")
    assert headers == {"x-smg-routing-key": "c1", "x-request-id": "r1"}
    assert (
        turn_headers("c1", session_header="x-session-id", request_id="r", final=True)["x-agentkv-final-turn"]
        == "true"
    )


def test_per_read_timeout_never_exceeds_the_remaining_deadline() -> None:
    now = [0.0]
    deadline = Deadline(20.0, clock=lambda: now[0])
    now[0] = 15.0
    timeout = Timeouts(total=20.0, connect=10.0, read=300.0).for_attempt(deadline)
    assert timeout.read == pytest.approx(5.0)
    assert timeout.connect == pytest.approx(5.0)
    assert Timeouts.coerce(7.0).total == 7.0


@respx.mock
def test_control_plane_paths_and_auth() -> None:
    lease = {"conversation_id": "c1", "lease": {"state": "held", "expires_in_s": 29.0, "renewable": True}}
    beat = respx.post(f"{BASE}/conversations/c1/heartbeat").respond(200, json=lease)
    get = respx.get(f"{BASE}/conversations/c1").respond(200, json=lease)
    delete = respx.delete(f"{BASE}/conversations/c1").respond(200, json={"released": True})
    control = ControlClient(base_url=BASE, api_key="secret")
    assert control.heartbeat("c1") == lease
    assert control.lookup("c1") == lease
    assert control.release("c1") == {"released": True}
    assert beat.calls.last.request.headers["authorization"] == "Bearer secret"
    assert get.called and delete.called


@respx.mock
def test_control_plane_absent_endpoint_is_none() -> None:
    respx.post(f"{BASE}/conversations/c1/heartbeat").respond(404, json={"detail": "Not Found"})
    respx.delete(f"{BASE}/conversations/c1").respond(405)
    control = ControlClient(base_url=BASE)
    assert control.heartbeat("c1") is None
    assert control.release("c1") is None


@respx.mock
def test_control_plane_errors_are_mapped() -> None:
    respx.post(f"{BASE}/conversations/c1/heartbeat").respond(
        503, json={"error": {"message": "no decode", "type": "upstream_error"}}
    )
    respx.get(f"{BASE}/conversations/c1").mock(side_effect=httpx.ConnectError("refused"))
    control = ControlClient(base_url=BASE)
    with pytest.raises(APIStatusError) as info:
        control.heartbeat("c1")
    assert info.value.status_code == 503 and info.value.error_type == "upstream_error"
    with pytest.raises(ConnectError):
        control.lookup("c1")


@respx.mock
def test_first_model() -> None:
    route = respx.get(f"{BASE}/models")
    route.respond(200, json={"object": "list", "data": [{"id": "tiny"}, {"id": "other"}]})
    assert first_model(BASE) == "tiny"
    route.respond(200, json={"object": "list", "data": []})
    with pytest.raises(ConfigError):
        first_model(BASE)

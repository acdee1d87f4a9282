"""The live planner under `infermesh up` (issue 30): a stepped load (quiet, busy,
quiet) makes it add decode instances and then remove them, through up's
supervisor, with no failed request. Real processes: nats-server, kvcache, prefill,
decode, the balancer and the planner (python -m services.planner).

The profile is written here for this test's mesh: one decode instance of the tiny
CPU model is said to give 20 output tokens/s whatever its batch (the real one gives
more; the planner's correction may at most halve the latency it predicts, so at
most 40). The busy step asks for ~4 requests/s of 16 tokens, 64 tokens/s: two or
more instances, capped at 3; the quiet steps ask for one."""

import threading
import time

import openai

from services.planner.profile import DecodePoint, PrefillPoint, Profile
from tests.helpers.mesh import live_instances

INTERVAL_S = 1.5
MESH_ENV = {
    "INFERMESH_PLANNER__INTERVAL_S": str(INTERVAL_S),
    "INFERMESH_PLANNER__STARTUP_S": str(INTERVAL_S),
    "INFERMESH_PLANNER__TTFT_MS": "20000",
    "INFERMESH_PLANNER__ITL_MS": "5000",
    "INFERMESH_PLANNER__MAX_REPLICAS": "3",
}
OUTPUT_TOKENS = 16


def small_profile(path) -> str:  # noqa: ANN001
    prefill = [PrefillPoint(n, c, ttft_ms=n * c * 0.5, tokens_per_s=2000.0) for n in (8, 64, 512) for c in (1, 8)]
    decode = [DecodePoint(b, ctx, itl_ms=50.0 * b, tokens_per_s=20.0) for b in (1, 2, 4, 8) for ctx in (16, 256)]
    profile = Profile("tiny", "synthetic (this test)", "-", "tests/mesh/test_planner_live.py", 0.0,
                      prefill=prefill, decode=decode)
    profile.save(path)
    return str(path)


def test_a_stepped_load_makes_the_planner_add_and_remove_decode_instances(start_mesh, tmp_path) -> None:
    mesh = start_mesh(num_prefill=1, num_decode=1, supervise=True, extra_env=MESH_ENV,
                      planner_profile=small_profile(tmp_path / "profile.json"))
    client = openai.OpenAI(base_url=mesh.api_url, api_key="x", max_retries=0, timeout=60)
    name = client.models.list().data[0].id
    failed: list[str] = []
    answered = [0]
    sent = [0]
    rate = [0.5]  # requests/s, changed by the test
    stop = threading.Event()

    def one(i: int) -> None:
        try:
            out = client.completions.create(model=name, prompt=f"step {i}: a b c", max_tokens=OUTPUT_TOKENS,
                                            temperature=0, extra_body={"ignore_eos": True})
            assert out.usage.completion_tokens == OUTPUT_TOKENS
            answered[0] += 1
        except Exception as exc:  # noqa: BLE001  (every failure is the test's finding)
            failed.append(f"{type(exc).__name__}: {exc}")

    def arrivals() -> None:  # open loop: requests arrive at the rate, whatever the latency
        i = 0
        while not stop.is_set():
            threading.Thread(target=one, args=(i,), daemon=True).start()
            i += 1
            sent[0] = i
            time.sleep(1.0 / rate[0])

    seen: list[int] = []  # decode instances in the registry, sampled

    def wait_for(what: str, check, timeout_s: float) -> None:  # noqa: ANN001
        deadline = time.monotonic() + timeout_s
        while not check():
            assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s (decode counts seen {seen})"
            seen.append(live_instances(mesh).get("decode", 0))
            time.sleep(0.5)

    feeder = threading.Thread(target=arrivals, daemon=True)
    feeder.start()
    try:
        time.sleep(4 * INTERVAL_S)
        assert live_instances(mesh).get("decode") == 1  # quiet: one is enough
        rate[0] = 4.0
        wait_for("a second decode instance", lambda: live_instances(mesh).get("decode", 0) >= 2, 90)
        rate[0] = 0.4
        wait_for("back to one decode instance", lambda: live_instances(mesh).get("decode", 0) == 1, 120)
    finally:
        stop.set()
        feeder.join(10)
    deadline = time.monotonic() + 60
    while threading.active_count() > 2 and time.monotonic() < deadline:  # in-flight requests finish
        time.sleep(0.2)
    assert failed == []
    # Every request sent was answered (how many ran depends on how fast the planner acts).
    assert answered[0] == sent[0] > 10
    log = (mesh.state_dir / "logs" / "planner.log").read_text()
    assert "scaling" in log and "'decode'" in log
    assert mesh.restarts == {}

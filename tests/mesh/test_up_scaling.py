"""`infermesh up` scaled live (issue 30's "through up's supervisor"): a planner writes
<state_dir>/replicas.json and the supervisor starts or drains instances until each
stage has its count. Real processes: nats-server (which reloads its users for each
instance up to the planner's max_replicas, made at start), kvcache, prefill, decode and the balancer.

Checked, under a steady stream of requests: scaled up, the new instances log in with
NATS users made at start, join the registry and take requests; scaled down, the
highest-numbered instances drain and exit; nats-server never reloads its config (a
reload drops the reply grants of requests in flight); and no request fails meanwhile."""

import threading
import time

import openai

from shared.runtime.desired_replicas import write_desired
from tests.helpers.mesh import live_instances

PROMPTS = [f"scaling {i}: one two three four" for i in range(64)]


def wait_for(what: str, check, timeout_s: float = 90.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s:.0f} s"
        time.sleep(0.2)


def test_replicas_file_scales_each_stage_up_and_down_with_no_failed_request(start_mesh) -> None:
    mesh = start_mesh(num_prefill=1, num_decode=1, supervise=True)
    client = openai.OpenAI(base_url=mesh.api_url, api_key="x", max_retries=0, timeout=60)
    name = client.models.list().data[0].id
    answered: list[int] = []
    failed: list[str] = []
    stop = threading.Event()

    def load(worker: int) -> None:
        i = worker
        while not stop.is_set():
            try:
                out = client.completions.create(model=name, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=12,
                                                temperature=0, extra_body={"ignore_eos": True})
                answered.append(out.usage.completion_tokens)
            except Exception as exc:  # noqa: BLE001  (every failure is the test's finding)
                failed.append(f"{type(exc).__name__}: {exc}")
            i += 3

    threads = [threading.Thread(target=load, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    try:
        write_desired(mesh.replicas_file, {"prefill": 2, "decode": 2})
        wait_for("2 prefill and 2 decode in the registry",
                 lambda: live_instances(mesh) == {"prefill": 2, "decode": 2})
        assert mesh.instances("decode") == ["decode-0", "decode-1"]
        users_at_start = mesh.nats_config.read_text()
        assert "decode-1" in users_at_start and "decode-15" in users_at_start  # made at start, in force
        before = len(answered)
        wait_for("requests served after scaling up", lambda: len(answered) >= before + 6)

        write_desired(mesh.replicas_file, {"prefill": 1, "decode": 1})
        wait_for("decode-1 and prefill-1 gone",
                 lambda: not {"decode-1", "prefill-1"} & {n for n, _ in mesh.procs})
        wait_for("1 prefill and 1 decode in the registry",
                 lambda: live_instances(mesh) == {"prefill": 1, "decode": 1})
        assert mesh.nats_config.read_text() == users_at_start  # the users stay: nothing to reload
        before = len(answered)
        wait_for("requests served after scaling down", lambda: len(answered) >= before + 6)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert failed == []
    assert all(n == 12 for n in answered)
    assert mesh.restarts == {}  # scaled away is not died: nothing was restarted
    assert "Reloaded server configuration" not in (mesh.state_dir / "logs" / "nats.log").read_text()

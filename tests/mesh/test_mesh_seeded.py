"""Deterministic sampling through a real mesh (issue 14, point 4): 1 prefill and 2
decode instances as processes. A seeded sampled request gives the text the offline
engine gives: alone, inside a batch, and when its decode instance is SIGKILLed
mid-stream (the rest is drawn on the other instance after a migration, and a run
after the kill is served there alone). A request without a seed gets one from the
balancer, named in system_fingerprint and x-infermesh-seed, and sending it back
gives the same text."""

import signal
import threading
import time

import httpx
import openai

from services.balancer.frontend.seeds import SEED_HEADER, seed_of_fingerprint
from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from shared.proto import mesh_pb2
from shared.runtime import subjects
from tests.helpers.metrics import balancer_metric as metric
from tests.helpers.nats_listener import Listener

PROMPT = "def parse_config(path):\n    "
SEED = 31337
MAX_TOKENS = 160
SAMPLING = dict(temperature=1.0, top_p=0.95)


def test_seeded_text_alone_batched_on_either_decode_and_across_a_kill(start_mesh, mesh_model_dir):
    running: dict[str, int] = {}

    def on_heartbeat(msg) -> None:  # noqa: ANN001
        hb = mesh_pb2.Heartbeat()
        hb.ParseFromString(msg.data)
        running[hb.instance_id] = hb.load.num_running

    heartbeats = Listener(subjects.heartbeats_of("decode"), on_heartbeat)
    mesh = start_mesh(num_prefill=1, num_decode=2)
    heartbeats.start(mesh.nats_url)
    client = openai.OpenAI(base_url=mesh.api_url, api_key="x", max_retries=0, timeout=120)
    name = client.models.list().data[0].id
    params = SamplingParams(max_tokens=MAX_TOKENS, seed=SEED, ignore_eos=True, **SAMPLING)
    expected = LLM(mesh_model_dir).generate([PROMPT], params)[0].text

    def seeded(**kw: object) -> str:
        out = client.completions.create(model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, seed=SEED,
                                        extra_body={"ignore_eos": True}, **SAMPLING, **kw)  # fmt: skip
        assert out.system_fingerprint == f"infermesh-seed-{SEED}"  # a client's own seed is named too
        return out.choices[0].text

    assert seeded() == expected

    # In a batch: other requests (unseeded, greedy, other lengths) decode beside it.
    texts: dict[int, str] = {}

    def one(i: int) -> None:
        if i == 3:
            texts[i] = seeded()
        else:
            texts[i] = client.completions.create(
                model=name, prompt=f"{i}: " + PROMPT * (1 + i % 3), max_tokens=40 + 20 * i,
                temperature=[0.0, 1.0][i % 2], extra_body={"ignore_eos": True},
            ).choices[0].text
    threads = [threading.Thread(target=one, args=(i,)) for i in range(7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert texts[3] == expected

    # Killed mid-stream: SIGKILL the decode instance running it once tokens flow.
    streamed: list[str] = []
    error: list[BaseException] = []

    def stream() -> None:
        try:
            chunks = client.completions.create(model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, seed=SEED,
                                               stream=True, extra_body={"ignore_eos": True}, **SAMPLING)  # fmt: skip
            for chunk in chunks:
                if chunk.choices:
                    streamed.append(chunk.choices[0].text)
        except BaseException as exc:  # noqa: BLE001 - reported below
            error.append(exc)

    running.clear()
    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + 30
    victim = None
    while victim is None:
        assert time.monotonic() < deadline and reader.is_alive(), "the stream never ran on a decode instance"
        busy = [iid for iid, n in sorted(running.items()) if n >= 1]
        victim = busy[0] if busy and len(streamed) >= 4 else None
        time.sleep(0.01)
    dict(mesh.procs)[victim].send_signal(signal.SIGKILL)
    num_before = len(streamed)
    reader.join(120)
    assert not error
    assert num_before < MAX_TOKENS // 2  # killed mid-stream, not at its end
    assert metric(mesh, "migrations_total") >= 1
    assert "".join(streamed) == expected  # the other instance drew the rest as the first would have

    # Only the survivor is left: it alone gives the same text too.
    assert seeded() == expected


def test_unseeded_response_names_a_seed_that_reproduces_it(start_mesh):
    mesh = start_mesh(num_prefill=1, num_decode=1)
    client = openai.OpenAI(base_url=mesh.api_url, api_key="x", max_retries=0, timeout=120)
    name = client.models.list().data[0].id
    body = dict(model=name, prompt=PROMPT, max_tokens=32, extra_body={"ignore_eos": True}, **SAMPLING)
    raw = client.completions.with_raw_response.create(**body)
    first = raw.parse()
    seed = int(raw.headers[SEED_HEADER])
    assert seed_of_fingerprint(first.system_fingerprint) == seed
    again = client.completions.create(**body, seed=seed)
    assert again.choices[0].text == first.choices[0].text and again.system_fingerprint == first.system_fingerprint
    other = client.completions.create(**body)  # another draw: another seed, another text
    assert other.system_fingerprint != first.system_fingerprint and other.choices[0].text != first.choices[0].text

    # Chat, streamed, n = 2: every chunk names the seed; choice i ran with seed + i.
    chat = dict(model=name, messages=[{"role": "user", "content": "Write a loop."}], max_tokens=24, n=2,
                extra_body={"ignore_eos": True}, **SAMPLING)  # fmt: skip
    chunks = list(client.chat.completions.create(**chat, stream=True))
    fingerprints = {c.system_fingerprint for c in chunks}
    assert len(fingerprints) == 1
    chat_seed = seed_of_fingerprint(fingerprints.pop())
    assert chat_seed is not None
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(2)]  # fmt: skip
    whole = client.chat.completions.create(**chat, seed=chat_seed)
    assert [c.message.content for c in sorted(whole.choices, key=lambda c: c.index)] == streamed
    assert streamed[0] != streamed[1]

    # A seed out of range is the client's error, named.
    bad = httpx.post(f"{mesh.api_url}/completions", json={"model": name, "prompt": "x", "seed": -1}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "seed"

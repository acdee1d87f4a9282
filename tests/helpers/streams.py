"""A client's streams through a mesh under load, as the failover tests watch them:
each Stream records when its chunks came, its text and its error (a stream that
failed is counted, not raised)."""

import threading
import time
from dataclasses import dataclass, field

import openai


@dataclass
class Stream:
    prompt: str
    started: float = 0.0
    times: list[float] = field(default_factory=list)
    """When each chunk with text arrived (monotonic)."""
    text: str = ""
    completion_tokens: int | None = None
    error: str | None = None
    request_id: str = ""

    def stall(self) -> float:
        """The longest the client waited for something: from the start to the first
        chunk, or between two chunks."""
        points = [self.started, *self.times]
        return max(b - a for a, b in zip(points, points[1:])) if self.times else float("inf")


def stream_one(client: openai.OpenAI, name: str, s: Stream, max_tokens: int) -> None:
    """Stream s's prompt, greedy and ignoring EOS, into s."""
    s.started = time.monotonic()
    try:
        chunks = client.completions.create(
            model=name, prompt=s.prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        for chunk in chunks:
            s.request_id = chunk.id
            if chunk.choices and chunk.choices[0].text:
                s.times.append(time.monotonic())
                s.text += chunk.choices[0].text
            if chunk.usage is not None:
                s.completion_tokens = chunk.usage.completion_tokens
    except Exception as exc:  # counted as failed
        s.error = f"{type(exc).__name__}: {exc}"


def start_streams(client: openai.OpenAI, name: str, prompts: list[str], max_tokens: int,
                  daemon: bool = True) -> tuple[list[Stream], list[threading.Thread]]:  # fmt: skip
    """A Stream per prompt, each streamed (stream_one) on a thread of its own, all started."""
    streams = [Stream(p) for p in prompts]
    threads = [threading.Thread(target=stream_one, args=(client, name, s, max_tokens), daemon=daemon)
               for s in streams]  # fmt: skip
    for t in threads:
        t.start()
    return streams, threads

"""Time to first token of a long prompt through the disaggregated mesh, as containers
deploy it against the same mesh in one namespace, side by side in one run.

Two meshes run at once on the same checkpoint: one as `infermesh up` runs it (one
PID namespace: decode copies prefill's KV straight out of its mapped cache), one
whose kvcache, prefill and decode each have a PID namespace of their own and whose
UCX speaks TCP only, as between hosts (decode reads the KV through NIXL). Each
round sends one fresh prompt of --prompt-len random tokens to each mesh in turn
(the order rotates every round; the first round warms both and is dropped),
streams the completion and takes the first token's arrival. Prints the TTFTs,
the per-round ratio across/one, its median and spread, and each mesh's kv.path.

    .venv/bin/python -m tools.bench.ttft_bench --prompt-len 4000 --rounds 6
"""

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from tools.bench.raw_file import add_json_flag, write_rows
from tools.launch.up import Mesh, free_port


def ttft(api_url: str, model: str, prompt: list[int]) -> tuple[float, str]:
    """(seconds to the first streamed token, the completion's id). The stream is read
    to its end: a client that leaves after its first token cancels the request, and
    decode records where the KV came from (kv.path) only on a request that finishes."""
    started = time.perf_counter()
    first: float | None = None
    rid = ""
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{api_url}/completions", json=body, timeout=600,
                      headers={"Authorization": "Bearer x"}) as resp:  # fmt: skip
        resp.raise_for_status()
        for line in resp.iter_lines():
            if first is None and line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0].get("text") is not None:
                    first, rid = time.perf_counter() - started, chunk["id"]
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return first, rid


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: make the default model)")
    p.add_argument("--prompt-len", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=6, help="timed rounds (one more warms up)")
    p.add_argument("--block-size", type=int, default=16)
    add_json_flag(p)
    args = p.parse_args(argv)
    from shared.model.config import ModelConfig
    from tools.launch.trace_view import request_span
    from tools.make_model import make_model

    with tempfile.TemporaryDirectory(prefix="infermesh-ttft-") as tmp, ExitStack() as stack:
        model = args.model
        if model is None:
            model = f"{tmp}/model"
            make_model(Path(model))
        vocab = ModelConfig.from_pretrained(model).vocab_size
        env = {"INFERMESH_ENGINE__BLOCK_SIZE": str(args.block_size)}
        meshes = {
            "one": Mesh(model, 1, 1, free_port(), Path(tmp) / "one", extra_env=env),
            "across": Mesh(model, 1, 1, free_port(), Path(tmp) / "across", extra_env={**env, "UCX_TLS": "tcp"},
                           pid_namespaces=True),
        }  # fmt: skip
        for mesh in meshes.values():
            stack.callback(mesh.stop)
            mesh.start()
        name = httpx.get(f"{meshes['one'].api_url}/models", headers={"Authorization": "Bearer x"}).json()["data"][0]["id"]
        rng = random.Random(0)
        times: dict[str, list[float]] = {k: [] for k in meshes}
        ids: dict[str, list[str]] = {k: [] for k in meshes}
        order = list(meshes)
        for round_ in range(args.rounds + 1):
            turn = order[round_ % 2 :] + order[: round_ % 2]
            for key in turn:
                prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_len)]
                seconds, rid = ttft(meshes[key].api_url, name, prompt)
                if round_:
                    times[key].append(seconds)
                    ids[key].append(rid)
        # Each timed request's decode span: where its prompt KV came from.
        # ("local": the balancer had decode compute the prompt itself.)
        def path(span: dict) -> str:
            return "local" if span.get("prefill.local") else str(span.get("kv.path"))

        paths = {key: sorted({path(request_span(mesh.trace_dir, rid, "decode")) for rid in ids[key]})
                 for key, mesh in meshes.items()}  # fmt: skip
        ratios = [a / b for a, b in zip(times["across"], times["one"])]
        row = {
            "prompt_len": args.prompt_len, "rounds": args.rounds,
            "ttft_one_s": [round(t, 3) for t in times["one"]], "ttft_across_s": [round(t, 3) for t in times["across"]],
            "median_one_s": round(statistics.median(times["one"]), 3),
            "median_across_s": round(statistics.median(times["across"]), 3),
            "across_over_one_median": round(statistics.median(ratios), 3),
            "across_over_one_min": round(min(ratios), 3), "across_over_one_max": round(max(ratios), 3),
            "kv_path_one": paths["one"], "kv_path_across": paths["across"],
        }  # fmt: skip
        print(json.dumps(row), flush=True)
        write_rows(args.json, [{"round": i, "ttft_one_s": one, "ttft_across_s": across, "across_over_one": across / one}
                               for i, (one, across) in enumerate(zip(times["one"], times["across"]))],
                   summary=row)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

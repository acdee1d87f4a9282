"""Train the default model pair: a small Llama-family target and its draft, on the
Python standard library's own sources (text every machine with Python has).

    python -m tools.train.default_model --out models/trained --device cuda

Both models start as `make-model` checkpoints (the `tiny` and `tiny-draft` presets,
one tokenizer trained on the stdlib), are trained by next-token prediction with
transformers' reference implementation of the architecture, and are written back in
bf16 safetensors in the Hugging Face layout the engine loads. Everything that decides
the result is recorded in `training.json` beside them (seed, corpus and its split,
token counts, steps, batch, learning rate, the loss curve, the held-out loss, the
wall time, the machine), and `README.md` is the model card with a sample.

The split is by file: every `HELDOUT_EVERY`-th source file, in sorted path order, is
held out; the held-out loss is measured on fixed windows of those files.
"""

import argparse
import dataclasses
import hashlib
import json
import math
import platform
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

HELDOUT_EVERY = 20
CORPUS_BYTES = 64_000_000  # the whole stdlib (~35 MB of .py on CPython 3.11/3.12)
SAMPLE_PROMPTS = ("import os\n\n\ndef ", "class Parser:\n    def __init__(self, ")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup_steps: int
    weight_decay: float
    seed: int
    eval_every: int


@dataclasses.dataclass
class Corpus:
    train: np.ndarray
    heldout: np.ndarray
    num_files: int
    num_heldout_files: int
    num_bytes: int
    sha256: str
    """Of the train and held-out token arrays (uint16 little-endian), in that order."""


def build_corpus(tokenizer_path: Path, eos_id: int) -> Corpus:
    from tokenizers import Tokenizer

    from shared.recipe.train_tokenizer import stdlib_corpus

    texts = stdlib_corpus(CORPUS_BYTES)
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
    train: list[int] = []
    heldout: list[int] = []
    for i, enc in enumerate(encoded):
        (heldout if i % HELDOUT_EVERY == HELDOUT_EVERY - 1 else train).extend(enc.ids + [eos_id])
    train_arr = np.asarray(train, dtype=np.uint16)
    heldout_arr = np.asarray(heldout, dtype=np.uint16)
    digest = hashlib.sha256(train_arr.astype("<u2").tobytes() + heldout_arr.astype("<u2").tobytes()).hexdigest()
    return Corpus(train_arr, heldout_arr, len(texts), len(texts) // HELDOUT_EVERY,
                  sum(len(t.encode()) for t in texts), digest)  # fmt: skip


def _windows(tokens: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    offsets = torch.arange(seq_len + 1, device=starts.device)
    return tokens[starts[:, None] + offsets[None, :]].long()


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, heldout: torch.Tensor, seq_len: int, device: torch.device) -> float:
    """Mean next-token loss over non-overlapping windows covering the held-out tokens."""
    model.eval()
    starts = torch.arange(0, len(heldout) - seq_len - 1, seq_len, device=device)
    total, count = 0.0, 0
    for chunk in starts.split(64):
        batch = _windows(heldout, chunk, seq_len)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
        total += loss.item()
        count += batch[:, 1:].numel()
    model.train()
    return total / count


def train_one(path: Path, corpus: Corpus, cfg: TrainConfig, device: torch.device, log_prefix: str) -> dict:
    """Train the checkpoint in `path` in place; return its record."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    model.train()
    train = torch.from_numpy(corpus.train.astype(np.int64)).to(device)
    heldout = torch.from_numpy(corpus.heldout.astype(np.int64)).to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda")  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    curve: list[dict] = []
    start = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        lr = cfg.lr * min(step / cfg.warmup_steps, 0.5 * (1 + math.cos(math.pi * step / cfg.steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(train) - cfg.seq_len - 1, (cfg.batch_size,), generator=gen, device=device)
        batch = _windows(train, starts, cfg.seq_len)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % cfg.eval_every == 0 or step == cfg.steps:
            point = {"step": step, "train_loss": round(loss.item(), 4),
                     "heldout_loss": round(heldout_loss(model, heldout, cfg.seq_len, device), 4),
                     "seconds": round(time.perf_counter() - start, 1)}  # fmt: skip
            curve.append(point)
            print(f"{log_prefix} step {step}/{cfg.steps}: train {point['train_loss']:.3f} "
                  f"held-out {point['heldout_loss']:.3f} ({point['seconds']:.0f} s)", flush=True)  # fmt: skip
    seconds = time.perf_counter() - start
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    return {"params": params, "curve": curve, "heldout_loss": curve[-1]["heldout_loss"],
            "train_seconds": round(seconds, 1), "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len}  # fmt: skip


def sample(path: Path, prompt: str, max_new_tokens: int = 64) -> str:
    """Greedy continuation by transformers from the saved checkpoint (float32, CPU)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0], skip_special_tokens=True)


def write_card(out: Path, record: dict) -> None:
    t, d = record["target"], record["draft"]
    lines = [
        "# The default model pair: a target and its draft, trained on the Python stdlib",
        "",
        "Made by `python -m tools.train.default_model` "
        f"(`{' '.join(record['argv'])}`) on {record['machine']}, Python {record['python']}, "
        f"torch {record['torch']}; `training.json` holds every figure below and the loss curves.",
        "",
        "| | target (`target/`) | draft (`draft/`) |",
        "|---|---|---|",
        f"| shape | Llama, preset `tiny` | Llama, preset `tiny-draft` |",
        f"| parameters | {t['params']:,} | {d['params']:,} |",
        f"| tokens seen | {t['tokens_seen']:,} | {d['tokens_seen']:,} |",
        f"| held-out loss (nats/token) | {t['heldout_loss']:.3f} | {d['heldout_loss']:.3f} |",
        f"| training time | {t['train_seconds']:.0f} s | {d['train_seconds']:.0f} s |",
        "",
        f"Data: the `.py` sources of that Python's standard library ({record['corpus']['files']} files, "
        f"{record['corpus']['bytes']:,} bytes; test suites skipped), tokenized with the project's "
        f"byte-level BPE of {record['vocab_size']} tokens trained on the same sources; every "
        f"{HELDOUT_EVERY}th file held out ({record['corpus']['train_tokens']:,} training tokens, "
        f"{record['corpus']['heldout_tokens']:,} held out; sha256 {record['corpus']['sha256'][:16]}…). "
        f"Seed {record['train']['seed']}, {record['train']['steps']} steps of "
        f"{record['train']['batch_size']} × {record['train']['seq_len']} tokens, AdamW, "
        f"peak lr {record['train']['lr']}, cosine schedule.",
        "",
        "It writes Python-looking code, no more: a few million parameters learn the",
        "stdlib's idioms, not programming. It exists so that the mesh shows text and",
        "speculative decoding sees real acceptance rates. Greedy samples of the target:",
        "",
    ]
    for prompt, text in record["samples"].items():
        lines += ["```python", text, "```", ""]
    (out / "README.md").write_text("\n".join(lines))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="models/trained")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--draft-steps", type=int, default=None, help="default: --steps")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--mtp-steps", type=int, default=0, help="then train the target's MTP head (tools/train/mtp_head.py)")
    args = p.parse_args(argv)

    from tools.make_model import make_model

    out = Path(args.out)
    device = torch.device(args.device)
    make_model(out / "target", preset="tiny", seed=args.seed)
    make_model(out / "draft", preset="tiny-draft", seed=args.seed, tokenizer=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(out / "target" / name, out / "draft" / name)  # one tokenizer for both
    target_config = json.loads((out / "target" / "config.json").read_text())
    draft_config = json.loads((out / "draft" / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id"):
        draft_config[key] = target_config[key]
    (out / "draft" / "config.json").write_text(json.dumps(draft_config, indent=2, sort_keys=True) + "\n")
    eos = target_config["eos_token_id"]
    corpus = build_corpus(out / "target" / "tokenizer.json", eos if isinstance(eos, int) else eos[0])
    print(f"corpus: {corpus.num_files} files, {len(corpus.train):,} training and {len(corpus.heldout):,} "
          f"held-out tokens", flush=True)  # fmt: skip
    cfg = TrainConfig(args.steps, args.batch_size, args.seq_len, args.lr, max(args.steps // 20, 1), 0.1,
                      args.seed, args.eval_every)  # fmt: skip
    record: dict = {
        "argv": ["python", "-m", "tools.train.default_model", *(argv if argv is not None else sys.argv[1:])],
        "machine": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "vocab_size": target_config["vocab_size"],
        "train": dataclasses.asdict(cfg),
        "heldout_every": HELDOUT_EVERY,
        "corpus": {"files": corpus.num_files, "heldout_files": corpus.num_heldout_files, "bytes": corpus.num_bytes,
                   "train_tokens": len(corpus.train), "heldout_tokens": len(corpus.heldout),
                   "sha256": corpus.sha256},  # fmt: skip
    }
    record["target"] = train_one(out / "target", corpus, cfg, device, "target")
    draft_cfg = dataclasses.replace(cfg, steps=args.draft_steps or args.steps)
    record["draft"] = train_one(out / "draft", corpus, draft_cfg, device, "draft")
    record["samples"] = {prompt: sample(out / "target", prompt) for prompt in SAMPLE_PROMPTS}
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    write_card(out, record)
    if args.mtp_steps:  # after the target: it rewrites the checkpoint the head goes into
        from tools.train.mtp_head import main as train_mtp_head

        train_mtp_head(["--target", str(out / "target"), "--steps", str(args.mtp_steps), "--seed", str(args.seed)])
    print((out / "README.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())

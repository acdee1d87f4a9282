"""Train the default target's MTP head (shared/model/mtp.py, DeepSeek-V3's layout) and
write it into the target's checkpoint, for `speculative="mtp"`.

    python -m tools.train.mtp_head --target models/trained/target

The target stays frozen. On windows of the same corpus as the target's (the stdlib's
sources, the same split by file: tools/train/default_model.py), the MTP layer reads
the target's final hidden state h_i (after its final norm, as the engine hands it
over) and the embedding of t_{i+1}, and is trained by cross-entropy on t_{i+2}, through
the target's own LM head. Its block is transformers' Llama decoder layer, started from
the target's last layer; eh_proj starts small and random. Run after default_model.py:
re-training the target rewrites its checkpoint without the MTP layer.

Written: the layer's tensors in bf16 under DeepSeek's names
(``model.layers.{num_hidden_layers}.*``) inside ``target/model.safetensors``, with
``num_nextn_predict_layers: 1`` in its config.json (transformers' Llama ignores both);
the record (seed, steps, loss curve, held-out loss and top-1 agreement with the
target's own next prediction) in ``mtp_training.json`` beside the pair.
"""

import argparse
import dataclasses
import json
import math
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from tools.train.default_model import SAMPLE_PROMPTS, Corpus, TrainConfig, _windows, build_corpus

EVAL_WINDOWS = 48
"""Held-out windows in each evaluation along the way."""
FINAL_EVAL_WINDOWS = 384
"""Held-out windows of the final evaluation (~49k tokens: a minute on two CPU cores)."""


MtpTrainConfig = TrainConfig
"""The same knobs as the pair's training."""


class MtpTrainer(nn.Module):
    """The MTP layer in float32 for training, named as the checkpoint names it (after the
    ``model.layers.L.`` prefix; the block's names without ``block.``)."""

    def __init__(self, target: nn.Module) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

        c = target.config
        self.enorm = LlamaRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = LlamaRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        nn.init.normal_(self.eh_proj.weight, std=c.initializer_range)
        self.block = LlamaDecoderLayer(c, layer_idx=c.num_hidden_layers - 1)
        self.block.load_state_dict(target.model.layers[-1].state_dict())
        self.shared_head = nn.ModuleDict({"norm": LlamaRMSNorm(c.hidden_size, c.rms_norm_eps)})

    def forward(self, target: nn.Module, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, H] (h_0..h_{T-1}), next_ids [B, T] (t_1..t_T) -> logits of t_2..t_{T+1}."""
        embedded = target.model.embed_tokens(next_ids)
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        positions = torch.arange(x.shape[1], device=x.device)[None]
        rope = target.model.rotary_emb(x, position_ids=positions)
        t = x.shape[1]
        mask = torch.full((t, t), float("-inf"), device=x.device).triu(1)[None, None]
        out = self.block(x, attention_mask=mask, position_ids=positions, position_embeddings=rope)
        out = out[0] if isinstance(out, tuple) else out
        return target.lm_head(self.shared_head["norm"](out))

    def checkpoint_tensors(self, layer_index: int) -> dict[str, torch.Tensor]:
        prefix = f"model.layers.{layer_index}."
        return {prefix + name.removeprefix("block."): p.detach() for name, p in self.state_dict().items()}


def _batch_loss(
    mtp: MtpTrainer, target: nn.Module, batch: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """batch [B, L + 1] tokens -> (mean loss on t_{i+2}, hits vs the tokens, hits vs the
    target's own argmax at i + 1: what greedy verification accepts at depth 1)."""
    with torch.no_grad():
        hidden = target.model(input_ids=batch[:, :-1]).last_hidden_state  # [B, L, H], after the final norm
        target_next = target.lm_head(hidden[:, 1:]).argmax(-1)  # the target's prediction of t_{i+2}
    logits = mtp(target, hidden[:, :-1], batch[:, 1:-1])  # positions 0..L-2 predict t_2..t_L
    labels = batch[:, 2:]
    loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
    guess = logits.argmax(-1)
    return loss, (guess == labels).float().mean(), (guess == target_next).float().mean()


@torch.no_grad()
def evaluate(mtp: MtpTrainer, target: nn.Module, heldout: torch.Tensor, seq_len: int, windows: int | None) -> dict:
    mtp.eval()
    starts = torch.arange(0, len(heldout) - seq_len - 1, seq_len)[:windows]
    total = hits = agree = 0.0
    for chunk in starts.split(32):
        loss, hit, agreed = _batch_loss(mtp, target, _windows(heldout, chunk, seq_len))
        total, hits, agree = total + loss.item() * len(chunk), hits + hit.item() * len(chunk), agree + agreed.item() * len(chunk)
    mtp.train()
    n = len(starts)
    return {"heldout_loss": round(total / n, 4), "heldout_top1": round(hits / n, 4),
            "heldout_agreement": round(agree / n, 4), "heldout_tokens": n * (seq_len - 1)}  # fmt: skip


def train(target_path: Path, corpus: Corpus, cfg: MtpTrainConfig) -> tuple[MtpTrainer, dict]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.seed)
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    target.requires_grad_(False)
    mtp = MtpTrainer(target).train()
    train_tokens = torch.from_numpy(corpus.train.astype(np.int64))
    heldout = torch.from_numpy(corpus.heldout.astype(np.int64))
    decay = [p for p in mtp.parameters() if p.dim() >= 2]
    no_decay = [p for p in mtp.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))  # fmt: skip
    gen = torch.Generator().manual_seed(cfg.seed)
    curve: list[dict] = [{"step": 0, **evaluate(mtp, target, heldout, cfg.seq_len, EVAL_WINDOWS)}]
    start = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        lr = cfg.lr * min(step / cfg.warmup_steps, 0.5 * (1 + math.cos(math.pi * step / cfg.steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(train_tokens) - cfg.seq_len - 1, (cfg.batch_size,), generator=gen)
        loss, _, _ = _batch_loss(mtp, target, _windows(train_tokens, starts, cfg.seq_len))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
        opt.step()
        if step % cfg.eval_every == 0 or step == cfg.steps:
            windows = FINAL_EVAL_WINDOWS if step == cfg.steps else EVAL_WINDOWS
            point = {"step": step, "train_loss": round(loss.item(), 4),
                     **evaluate(mtp, target, heldout, cfg.seq_len, windows),
                     "seconds": round(time.perf_counter() - start, 1)}  # fmt: skip
            curve.append(point)
            print(f"mtp step {step}/{cfg.steps}: train {point['train_loss']:.3f} held-out {point['heldout_loss']:.3f} "
                  f"agreement {point['heldout_agreement']:.3f} ({point['seconds']:.0f} s)", flush=True)  # fmt: skip
    final = curve[-1]
    record = {"params": sum(p.numel() for p in mtp.parameters()), "curve": curve,
              "heldout_loss": final["heldout_loss"], "heldout_top1": final["heldout_top1"],
              "heldout_agreement": final["heldout_agreement"], "heldout_tokens": final["heldout_tokens"],
              "train_seconds": round(time.perf_counter() - start, 1),
              "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len}  # fmt: skip
    return mtp, record


def write(target_path: Path, mtp: MtpTrainer) -> None:
    """The layer in bf16 into the target's checkpoint (shared/model/mtp.py's save_mtp)."""
    from shared.model.mtp import save_mtp

    layer_index = json.loads((target_path / "config.json").read_text())["num_hidden_layers"]
    save_mtp(target_path, {n: t.to(torch.bfloat16) for n, t in mtp.checkpoint_tensors(layer_index).items()})


def engine_acceptance(target_path: Path, spec_tokens: int = 3, max_tokens: int = 64) -> dict:
    """The engine's greedy speculation with the written head on the card's prompts."""
    from shared.engine.llm import LLM
    from shared.engine.sampling_params import SamplingParams

    llm = LLM(str(target_path), speculative="mtp", spec_tokens=spec_tokens)
    llm.generate(list(SAMPLE_PROMPTS), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    load = llm.engine.load()
    return {"spec_tokens": spec_tokens, "prompts": list(SAMPLE_PROMPTS), "max_tokens": max_tokens,
            "mean_accepted_length": round(load.mean_accepted_length, 3),
            "verifications": load.num_spec_verifications, "accepted_by_position": load.spec_accepted_by_position}  # fmt: skip


CARD_HEADING = "## The MTP head (`speculative=\"mtp\"`)"


def write_card_section(card: Path, record: dict) -> None:
    """Put the MTP head's section at the end of the pair's README (replacing an older one)."""
    m, t = record["mtp"], record["train"]
    pair = card.parent / "training.json"
    target_loss = ""
    if pair.is_file():
        target_loss = f" (the target's on the next token: {json.loads(pair.read_text())['target']['heldout_loss']:.3f})"
    lines = [
        CARD_HEADING,
        "",
        f"`target/` also carries a multi-token-prediction layer in DeepSeek-V3's layout "
        f"(`model.layers.{record['layer_index']}.*`, `num_nextn_predict_layers: 1`; transformers' Llama "
        "ignores it), made by `python -m tools.train.mtp_head` "
        f"(`{' '.join(record['argv'])}`) on {record['machine']} ({record['threads']} threads), "
        f"torch {record['torch']}; `mtp_training.json` holds the figures and the loss curve.",
        "",
        f"- {m['params']:,} parameters of its own (eh_proj and one decoder layer, started from the "
        "target's last layer; the embedding and the LM head are the target's), bf16.",
        f"- The target frozen; {t['steps']} steps of {t['batch_size']} × {t['seq_len']} tokens "
        f"({m['tokens_seen']:,} tokens, {m['train_seconds']:.0f} s), AdamW, peak lr {t['lr']}, cosine, "
        f"seed {t['seed']}, on Python {record['python']}'s stdlib sources split by file as above "
        f"({record['corpus']['train_tokens']:,} training tokens).",
        f"- Held-out ({m['heldout_tokens']:,} positions of the held-out files): cross-entropy on the "
        f"token after next {m['heldout_loss']:.3f} nats{target_loss}; top-1 right {m['heldout_top1']:.1%}; "
        f"top-1 equal to the target's own greedy next prediction {m['heldout_agreement']:.1%} (what greedy "
        f"verification accepts of a first drafted token). The curve along the way is measured on the "
        f"first {EVAL_WINDOWS} held-out windows only, a harder subset.",
    ]
    a = record["engine"]
    lines.append(f"- In the engine (greedy, γ = {a['spec_tokens']}, the two sample prompts, {a['max_tokens']} tokens "
                 f"each): mean accepted length {a['mean_accepted_length']:.2f} tokens per verification; "
                 f"drafted token k accepted {a['accepted_by_position']} times in {a['verifications']}.")  # fmt: skip
    text = card.read_text() if card.is_file() else ""
    text = text.split(CARD_HEADING)[0].rstrip("\n")
    card.write_text(text + "\n\n" + "\n".join(lines) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="models/trained/target")
    p.add_argument("--record", default=None, help="default: mtp_training.json beside the target folder")
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=60)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--card-only", action="store_true", help="no training: measure the written head, rewrite the card")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target_path = Path(args.target)
    out = Path(args.record) if args.record else target_path.parent / "mtp_training.json"
    if args.card_only:
        record = json.loads(out.read_text())
        record.setdefault("layer_index", json.loads((target_path / "config.json").read_text())["num_hidden_layers"])
        record["engine"] = engine_acceptance(target_path)
        out.write_text(json.dumps(record, indent=2) + "\n")
        write_card_section(target_path.parent / "README.md", record)
        return 0
    config = json.loads((target_path / "config.json").read_text())
    eos = config["eos_token_id"]
    corpus = build_corpus(target_path / "tokenizer.json", eos if isinstance(eos, int) else eos[0])
    cfg = MtpTrainConfig(args.steps, args.batch_size, args.seq_len, args.lr, max(args.steps // 20, 1), 0.1,
                         args.seed, args.eval_every)  # fmt: skip
    print(f"corpus: {len(corpus.train):,} training and {len(corpus.heldout):,} held-out tokens", flush=True)
    mtp, trained = train(target_path, corpus, cfg)
    write(target_path, mtp)
    record = {
        "argv": ["python", "-m", "tools.train.mtp_head", *(argv if argv is not None else sys.argv[1:])],
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "train": dataclasses.asdict(cfg),
        "layer_index": config["num_hidden_layers"],
        "corpus": {"train_tokens": len(corpus.train), "heldout_tokens": len(corpus.heldout), "sha256": corpus.sha256},
        "mtp": trained,
    }
    record["engine"] = engine_acceptance(target_path)
    out.write_text(json.dumps(record, indent=2) + "\n")
    write_card_section(target_path.parent / "README.md", record)
    print(f"wrote the MTP layer into {target_path / 'model.safetensors'} and the record into {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

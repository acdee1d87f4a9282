"""A plan in words, as `infermesh plan` prints it: replicas, predicted latencies and
each token class's throughput and price. Apart from plan.py so the arithmetic has no
formatting in it."""

from services.planner.plan import TOKEN_CLASSES, Plan, Targets


def describe(plan: Plan, targets: Targets, gpu_hour_usd: float) -> str:
    p = f"p{targets.percentile:g}"
    lines = [
        "replicas: " + ", ".join(f"{stage} {n} ({plan.gpus[stage]} GPUs)" for stage, n in plan.replicas.items())
        + f"; total {plan.total_gpus} GPUs",
        f"predicted {p} TTFT {plan.predicted_ttft_ms:.1f} ms (target {targets.ttft_ms:g}; cache load "
        f"{plan.kv_load_ms:.1f} ms, handoff {plan.handoff_ms:.1f} ms"
        + (f", encoder {plan.vision.latency_ms:.1f} ms" if plan.vision else "") + ")",
        f"predicted {p} ITL {plan.predicted_itl_ms:.2f} ms (target {targets.itl_ms:g})",
        f"prefill instances at {plan.prefill.concurrency:.1f} prompts in flight, {plan.prefill.tokens_per_s:.0f} tok/s; "
        f"decode at batch {plan.decode.batch:.1f}, {plan.decode.tokens_per_s:.0f} tok/s",
        f"cost ${plan.usd_per_hour:.2f}/h at ${gpu_hour_usd:g}/GPU-h; ${plan.usd_per_million_blended:.4f} per million "
        "tokens blended",
        f"{'class':<16} {'tokens/GPU-h':>14} {'GPUs charged':>13} {'$/Mtok':>10}",
    ]
    for name in TOKEN_CLASSES:
        c = plan.classes[name]
        price = "-" if c.usd_per_million is None else f"{c.usd_per_million:.4f}"
        lines.append(f"{name:<16} {c.tokens_per_gpu_hour:>14,.0f} {c.gpus_charged:>13.2f} {price:>10}")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)

"""The replica counts a planner wants, handed to a supervisor that is not
Kubernetes: `infermesh up` (tools/launch/up.py) watches the file and starts or
drains instances until each stage has its count; the live planner
(services/planner) writes it. Dynamo's planner has the same seam (its "virtual"
connector: decisions published for an orchestrator outside Kubernetes).

A JSON object {stage: replicas}, written whole (a temporary file renamed over
it), so a reader never sees half a decision. It lives in the mesh's state
directory (mode 0700 under `up`): no port to open, nothing to authenticate.
"""

import json
import os
from pathlib import Path

SCALABLE_STAGES = ("prefill", "decode", "vision")
FILE_NAME = "replicas.json"


def write_desired(path: Path, replicas: dict[str, int]) -> None:
    """Write the wanted count of each stage named (stages not named keep theirs)."""
    for stage, count in replicas.items():
        if stage not in SCALABLE_STAGES:
            raise ValueError(f"cannot scale {stage!r}: the stages that scale are {', '.join(SCALABLE_STAGES)}")
        if not isinstance(count, int) or count < 0:
            raise ValueError(f"{stage} replicas must be a whole number >= 0, not {count!r}")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(replicas, sort_keys=True) + "\n")
    os.replace(tmp, path)


def read_desired(path: Path) -> dict[str, int]:
    """The counts in the file ({} when there is none); ValueError for a file that is not one."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not an object of stage -> replicas")
    out: dict[str, int] = {}
    for stage, count in raw.items():
        if stage not in SCALABLE_STAGES or not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"{path}: {stage!r}: {count!r} is not a stage and a count")
        out[stage] = count
    return out

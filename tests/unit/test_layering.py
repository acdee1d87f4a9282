"""The layering, checked: which folder may import which, and what loads torch.

tools sit on top (nothing imports them); services use shared, never each
other; in shared, the engine-stage skeleton (stage) uses the engine and the
plumbing (runtime); the engine uses the model; kv's vocabulary (block hash,
specs, transfer descriptors, events) is below them all. runtime's settings nest
the engine's torch-free EngineConfig, which is the one engine module the
plumbing reads.

The KV system (shared/kv) in layers: the vocabulary; the engine's KV memory,
which reads of the engine only its request state and config; the connectors,
over the memory, the wire and the plumbing; the kvcache wire, torch-free and
engine-free. The engine drives the connector interface and never a concrete
connector (those that need the network are the stage skeleton's to choose).

Inside the balancer, the OpenAI front door (frontend) and the mesh router
(router) are two services that meet only through the seam,
services.balancer.generation (the Generator contract and its request and event
types): neither imports the other, nor the wiring above them (service.py,
local.py, __main__), which imports both.

Imports are read off the source (every import statement, those inside
functions too), so an import that only runs on some path still counts."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Folder (as a module prefix) -> module prefixes it must not import.
FORBIDDEN = {
    "shared": ("tools", "services"),
    "shared.kv": ("shared.stage",),
    "shared.kv.memory": ("shared.runtime", "shared.kv.connectors", "shared.kv.wire", "shared.model"),
    "shared.kv.connectors": ("shared.engine",),
    "shared.kv.wire": ("shared.engine", "shared.kv.memory", "shared.kv.connectors", "shared.model"),
    "shared.model": ("shared.engine", "shared.runtime", "shared.stage", "shared.kv.memory", "shared.kv.connectors",
                     "shared.kv.wire"),
    "shared.engine": ("shared.runtime", "shared.stage", "shared.kv.wire"),
    "shared.runtime": ("shared.stage", "shared.kv.memory", "shared.kv.connectors"),
    "services": ("tools",),
}
KV_VOCABULARY = ("shared.kv.block_hash", "shared.kv.spec", "shared.kv.transfer", "shared.kv.events")
"""Import nothing of the project but each other and the generated protobuf code."""
KV_MEMORY_READS_OF_THE_ENGINE = ("shared.engine.request", "shared.engine.config")
"""The request state the managers update and the config's choices: torch-free, and
themselves importing no KV memory."""
ENGINE_SEES_OF_THE_CONNECTORS = ("shared.kv.connectors.base",)
FAMILY_CONFIGS_BUILD_ON = (
    "shared.model.arch_config",
    "shared.model.moe_config",
    "shared.model.vision_language_config",
)
"""Of the model, all a family's config module (models/<name>_config.py) may import.
Not shared.model.config: ModelConfig names DeepSeek-V4's parameters, so a family config
that imported it would close a circle (arch_config was cut out of config.py for that)."""
BALANCER_PARTS = ("services.balancer.frontend", "services.balancer.router")
"""Each may import, of the balancer, only itself and the seam."""
BALANCER_SEAM = "services.balancer.generation"
TORCH_FREE = (
    "shared.engine.config",
    # What an expert-parallel engine reports of its experts' load, for the heartbeat.
    "shared.engine.eplb.expert_load",
    "shared.engine.eplb.balancer",
    "shared.engine.outputs",
    "shared.engine.sampling_params",
    "shared.runtime.settings",
    "shared.stage.convert",
    "shared.model.config",
    "shared.model.arch_config",
    # The model registry, which imports every family's config parser (models/<name>_config.py).
    "shared.model.models",
    # M-RoPE positions: computed where a request's prompt is built, before any device.
    "shared.model.vision.mrope",
    *KV_VOCABULARY,
    "shared.kv.connectors.base",
    "shared.kv.wire.client",
    "shared.kv.wire.shm",
    "shared.kv.wire.block_stream",
    "shared.kv.wire.nixl",
    "shared.kv.wire.nixl_plane",
    "shared.kv.wire.targets",
    # Request images: the balancer loads them (the vision stage takes the pixels on), and
    # counts each one's placeholder tokens where it tokenises.
    "shared.multimodal.loader",
    "shared.multimodal.grid",
    # Where a prompt's images are and their positions: on the request state the KV memory reads.
    "shared.engine.prompt_images",
    # The planner: profile, stage models, plan, forecast, correction, Helm values; the
    # live planner service runs beside the mesh on a node with no accelerator.
    "services.planner.profile",
    "services.planner.stage_model",
    "services.planner.plan",
    "services.planner.plan_text",
    "services.planner.forecast",
    "services.planner.correction",
    "services.planner.helm_values",
    "services.planner.planner",
    "services.planner.observe",
    "services.planner.scalers",
    "services.planner.service",
    "shared.runtime.desired_replicas",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def sources(*folders: str) -> list[Path]:
    return [p for folder in folders for p in sorted((ROOT / folder).rglob("*.py")) if "proto" not in p.parts]


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_no_import_runs_against_the_layering():
    files = sources("shared", "services", "tools")
    assert len(files) > 60, "the walk found too few files"
    wrong = []
    for path in files:
        name = module_name(path)
        for imported in imported_modules(path):
            for folder, banned in FORBIDDEN.items():
                if within(name, folder) and any(within(imported, b) for b in banned):
                    wrong.append(f"{name} imports {imported}")
    assert not wrong, "\n".join(wrong)


def _project_imports(folder: str) -> list[tuple[str, str]]:
    """(module, imported project module) for every module of the folder."""
    return [
        (module_name(path), imported)
        for path in sources(folder.replace(".", "/"))
        for imported in sorted(imported_modules(path))
        if imported.split(".")[0] in ("shared", "services", "tools")
    ]


def test_the_kv_vocabulary_imports_nothing_above_it():
    wrong = [
        f"{name} imports {imported}"
        for name, imported in _project_imports("shared.kv")
        if name in KV_VOCABULARY
        and not any(within(imported, allowed) for allowed in (*KV_VOCABULARY, "shared.proto"))
    ]
    assert not wrong, "\n".join(wrong)


def test_the_kv_memory_reads_only_the_engines_request_state_and_config():
    wrong = [
        f"{name} imports {imported}"
        for name, imported in _project_imports("shared.kv.memory")
        if within(imported, "shared.engine") and imported not in KV_MEMORY_READS_OF_THE_ENGINE
    ]
    assert not wrong, "\n".join(wrong)
    for module in KV_MEMORY_READS_OF_THE_ENGINE:  # or the memory and the engine would import each other
        path = ROOT / (module.replace(".", "/") + ".py")
        assert not any(within(imported, "shared.kv.memory") for imported in imported_modules(path)), module


def test_the_engine_drives_connectors_through_their_interface_only():
    """A concrete connector (the network, the host tier, a peer's cache) is the stage
    skeleton's choice (shared/kv/connectors/chain.py); the engine sees the interface."""
    wrong = [
        f"{name} imports {imported}"
        for name, imported in _project_imports("shared.engine")
        if within(imported, "shared.kv.connectors") and imported not in ENGINE_SEES_OF_THE_CONNECTORS
    ]
    assert not wrong, "\n".join(wrong)


def test_family_configs_build_on_arch_config_never_on_model_config():
    """ModelConfig (shared/model/config.py) names DeepSeek-V4's parameters and the
    registry's families; what the families build on (ArchConfig, ArchTraits, RopeConfig,
    parse_rope) sits below both, in shared/model/arch_config.py, and imports nothing of
    the project: no arrow goes back up from a family's config to ModelConfig."""
    family_configs = sorted((ROOT / "shared/model/models").glob("*_config.py"))
    assert len(family_configs) >= 4, "the walk found too few family configs"
    wrong = [
        f"{module_name(path)} imports {imported}"
        for path in family_configs
        for imported in sorted(imported_modules(path))
        if within(imported, "shared") and imported not in FAMILY_CONFIGS_BUILD_ON
    ]
    wrong += [
        f"shared.model.arch_config imports {imported}"
        for imported in sorted(imported_modules(ROOT / "shared/model/arch_config.py"))
        if imported.split(".")[0] in ("shared", "services", "tools")
    ]
    assert not wrong, "\n".join(wrong)


def test_only_tools_and_tests_draw_checkpoints():
    """make_model (seeded random checkpoints) is a tool: no service or shared module
    imports it (FORBIDDEN covers it too; this names it)."""
    wrong = [
        f"{module_name(path)} imports {imported}"
        for path in sources("shared", "services")
        for imported in imported_modules(path)
        if within(imported, "tools.make_model")
    ]
    assert not wrong, "\n".join(wrong)


def test_services_never_import_each_other():
    wrong = []
    for path in sources("services"):
        stage = path.relative_to(ROOT).parts[1]
        for imported in imported_modules(path):
            if within(imported, "services") and not within(imported, f"services.{stage}"):
                wrong.append(f"{module_name(path)} imports {imported}")
    assert not wrong, "\n".join(wrong)


def test_the_balancers_front_door_and_router_meet_only_at_the_seam():
    wrong = []
    parts_seen = set()
    for path in sources("services/balancer"):
        name = module_name(path)
        part = next((p for p in BALANCER_PARTS if within(name, p)), None)
        if part is None:
            continue
        parts_seen.add(part)
        for imported in imported_modules(path):
            if within(imported, "services.balancer") and not (
                within(imported, part) or imported == BALANCER_SEAM
            ):
                wrong.append(f"{name} imports {imported}")
    assert parts_seen == set(BALANCER_PARTS), "the walk missed a part"
    assert not wrong, "\n".join(wrong)


def _torch_after_importing(modules: list[str]) -> list[str]:
    """Import the modules in a fresh interpreter; the torch modules it then holds."""
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_every_balancer_module_imports_without_torch():
    """The HTTP front door runs on machines without an accelerator stack: none of
    its modules (local.py included: it imports the engine only when one starts)
    may load torch. __main__ is left out: importing it starts the service, and it
    imports nothing but service.py and the service skeleton."""
    code = (
        "import pkgutil, services.balancer as b\n"
        "print('\\n'.join(m.name for m in pkgutil.walk_packages(b.__path__, 'services.balancer.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    modules = [m for m in out.stdout.split() if not m.endswith(".__main__")]
    assert {
        "services.balancer.service", "services.balancer.local", "services.balancer.frontend.serving",
        "services.balancer.frontend.tool_parsers.hermes", "services.balancer.router.orchestrator",
    } <= set(modules)
    assert _torch_after_importing(modules) == []


@pytest.mark.parametrize("module", TORCH_FREE)
def test_types_that_cross_a_process_boundary_are_torch_free(module):
    assert _torch_after_importing([module]) == []


def test_every_model_file_has_its_config_and_entry():
    """The registry's one list names, for each family, a torch-free config module
    (checked above through shared.model.models) and a model file exporting ENTRY."""
    from shared.model.interface import ModelEntry
    from shared.model.models import ARCH_CONFIGS, FAMILIES, model_entry

    for family in FAMILIES:
        assert (ROOT / "shared/model/models" / f"{family}.py").is_file()
        assert (ROOT / "shared/model/models" / f"{family}_config.py").is_file()
    for architecture, config in ARCH_CONFIGS.items():
        entry = model_entry(architecture)
        assert isinstance(entry, ModelEntry) and entry.config is config


def test_kernel_choices_are_one_tuple():
    """EngineConfig validates `kernels` torch-free; shared/model/kernels resolves it
    and keeps its own copy (the model must not import the engine)."""
    from shared.engine.config import KERNEL_CHOICES, EngineConfig
    from shared.model.kernels import KERNEL_CHOICES as MODEL_KERNEL_CHOICES

    assert KERNEL_CHOICES == MODEL_KERNEL_CHOICES
    assert EngineConfig().kernels in KERNEL_CHOICES


def test_quantized_weights_choices_are_one_tuple():
    """The same split as `kernels`: the engine validates torch-free, the model resolves."""
    from shared.engine.config import QUANTIZED_WEIGHTS_CHOICES, EngineConfig
    from shared.model.kept_weights import QUANTIZED_WEIGHTS_CHOICES as MODEL_CHOICES

    assert QUANTIZED_WEIGHTS_CHOICES == MODEL_CHOICES
    assert EngineConfig().quantized_weights == "dequantize"


def test_engine_dtypes_all_have_a_torch_dtype():
    import torch

    from shared.engine.config import DTYPES
    from shared.engine.dtypes import torch_dtype

    assert [torch_dtype(d) for d in DTYPES] == [torch.float32, torch.bfloat16, torch.float16]
    with pytest.raises(ValueError, match="dtype must be one of"):
        torch_dtype("float64")


def test_tests_share_code_through_tests_helpers_only():
    """No module under tests/ imports a test module or a conftest (fixtures reach tests
    through the conftest.py files, which pytest loads; a conftest is never imported):
    what tests share is in tests.helpers. Also refused: a relative import, and a bare
    import of a file under tests/ (through a sys.path entry), which would dodge the rule."""
    tests = ROOT / "tests"
    files = sorted(tests.rglob("*.py"))
    assert len(files) > 90, "the walk found too few files"
    local = {p.stem for p in files} - {"__init__"}
    wrong = []
    for path in files:
        where = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                wrong.append(f"{where}:{node.lineno} imports relatively (from {'.' * node.level}{node.module or ''})")
                continue
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module] if node.module != "tests" else [f"tests.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                if within(name, "tests.helpers") or name == "tests":
                    continue
                if within(name, "tests") or name.split(".")[0] in local:
                    wrong.append(f"{where}:{node.lineno} imports {name}")
    assert not wrong, "import from tests.helpers instead:\n" + "\n".join(wrong)

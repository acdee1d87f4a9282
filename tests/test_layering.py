"""The layering, checked: which folder may import which, and what loads torch.

tools sit on top (nothing imports them); services use shared, never each
other; in shared, the engine-stage skeleton (stage) uses the engine and the
plumbing (runtime); the engine uses the model; kv (the block hash) is below
them all. runtime's settings nest the engine's torch-free EngineConfig, which
is the one engine module the plumbing reads.

Imports are read off the source (every import statement, those inside
functions too), so an import that only runs on some path still counts."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Folder (as a module prefix) -> module prefixes it must not import.
FORBIDDEN = {
    "shared": ("tools", "services"),
    "shared.kv": ("shared.runtime", "shared.stage"),
    "shared.model": ("shared.engine", "shared.runtime", "shared.stage"),
    "shared.engine": ("shared.runtime", "shared.stage"),
    "shared.runtime": ("shared.stage",),
    "services": ("tools",),
}
TORCH_FREE = (
    "shared.engine.config",
    "shared.engine.outputs",
    "shared.engine.sampling_params",
    "shared.runtime.settings",
    "shared.stage.convert",
    "shared.model.config",
    # The model registry, which imports every family's config parser (models/<name>_config.py).
    "shared.model.models",
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
    assert {"services.balancer.service", "services.balancer.local", "services.balancer.serving"} <= set(modules)
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


def test_engine_dtypes_all_have_a_torch_dtype():
    import torch

    from shared.engine.config import DTYPES
    from shared.engine.dtypes import torch_dtype

    assert [torch_dtype(d) for d in DTYPES] == [torch.float32, torch.bfloat16, torch.float16]
    with pytest.raises(ValueError, match="dtype must be one of"):
        torch_dtype("float64")

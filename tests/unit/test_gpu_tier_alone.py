"""The GPU tier runs on the device machine without the conftest (`pytest --noconftest
tests/gpu`: the device lacks test-only packages tests/conftest.py imports), so every
fixture a tests/gpu test asks for must come from its module, a helper it imports, or
pytest and its plugins. Checked here by collecting the tier that way, in a fresh
interpreter, and asking pytest where each fixture of each test is defined."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

COLLECT = r"""
import json, sys
import pytest

class Fixtures:
    def pytest_collection_modifyitems(self, session, config, items):
        manager = session._fixturemanager
        params = lambda item: getattr(getattr(item, "callspec", None), "params", {})
        self.missing = [f"{item.nodeid} asks for {name}" for item in items for name in item.fixturenames
                        if name != "request" and name not in params(item)
                        and not manager.getfixturedefs(name, item)]
        self.count = len(items)

plugin = Fixtures()
code = pytest.main(["-q", "-p", "no:cacheprovider", "--noconftest", "--collect-only", "tests/gpu"], plugins=[plugin])
print("RESULT " + json.dumps({"code": int(code), "count": plugin.count, "missing": plugin.missing}))
"""


def test_every_gpu_test_finds_its_fixtures_without_the_conftest():
    out = subprocess.run([sys.executable, "-c", COLLECT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, out.stdout[-2000:] + out.stderr[-2000:]
    result = json.loads(line.removeprefix("RESULT "))
    assert result["code"] == 0, out.stdout[-2000:]
    assert result["count"] > 30, "the collection found too few tests"
    assert result["missing"] == [], "fixtures only a conftest defines:\n" + "\n".join(result["missing"])

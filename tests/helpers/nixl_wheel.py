"""Skip a test module where no NIXL wheel is installed, whichever wheel it is: the
wire module's nixl_api() picks nixl-cu12 or nixl-cu13 as the connector will (by the
CUDA of the torch already imported), and says NixlUnavailable when neither is here.
pytest.importorskip("nixl_cu12") would skip on a CUDA 13 machine that has nixl-cu13.

    skip_without_nixl()   # at module level, after the imports (torch among them)
"""

import pytest

from shared.kv.wire.nixl import NixlUnavailable, nixl_api


def skip_without_nixl() -> None:
    try:
        nixl_api()
    except NixlUnavailable as exc:
        pytest.skip(str(exc), allow_module_level=True)

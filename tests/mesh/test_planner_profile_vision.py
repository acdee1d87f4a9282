"""`infermesh profile` measures the vision stage of a real E/P/D mesh (nats-server,
kvcache, one vision, one prefill, one decode instance and the balancer as processes,
on a make-model tiny-vl Qwen2.5-VL): chats with images no cache holds go through the
balancer, and the profile gets a vision point per concurrency and image size asked
for, with figures off the balancer's vision series, which a plan with images then
uses at its image size."""

from pathlib import Path

from services.planner.plan import Lengths, Targets, Workload, plan
from services.planner.profile import Profile
from tests.helpers.mesh import running_mesh
from tests.helpers.metrics import balancer_metric
from tests.helpers.vl_mesh import ENV
from tools.cli import main
from tools.make_model import make_model


def test_the_sweep_measures_the_vision_stage_and_a_plan_sizes_it(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-vl"
    make_model(folder, arch="qwen2_5_vl", preset="tiny-vl", seed=3)
    with running_mesh(str(folder), tmp_path / "state", extra_env=ENV, num_prefill=1, num_decode=1,
                      num_vision=1) as mesh:  # fmt: skip
        out, raw = tmp_path / "profile.json", tmp_path / "profile.txt"
        assert main(["profile", "--url", mesh.api_url, "--out", str(out), "--raw", str(raw), "--no-plot",
                     "--budget-s", "900", "--prefill-lengths", "32", "64", "--prefill-concurrency", "1",
                     "--decode-batches", "1", "2", "--decode-contexts", "64", "--decode-max-tokens", "8",
                     "--vision-concurrency", "1", "4", "--vision-image-px", "56", "112", "--rounds", "2"]) == 0
        # Every image the sweep sent (2 concurrencies x 2 sizes x (warm-up + 2 rounds), 1 + 4 images per
        # size) was a vision instance's.
        assert balancer_metric(mesh, "vision_images_total", site="vision") == 3 * 2 * (1 + 4)
    profile = Profile.load(out)
    assert [(v.concurrency, v.image_px) for v in profile.vision] == [(1, 56), (1, 112), (4, 56), (4, 112)]
    assert all(v.images_per_s > 0 and v.latency_ms > 0 for v in profile.vision)
    assert profile.settings["sweep.vision_image_px"] == "56,112"
    assert "## vision" in raw.read_text()
    workload = Workload(1.0, Lengths(64), Lengths(8), images_per_request=1, image_px=80)
    planned = plan(profile, workload, Targets(ttft_ms=60_000, itl_ms=10_000), 1.0)
    assert planned.vision is not None and planned.replicas["vision"] >= 1

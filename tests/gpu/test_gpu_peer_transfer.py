"""Direct prefill -> decode KV transfer by CUDA IPC between two processes (run on the
device machine: `python -m pytest -q tests/gpu`): a prefill engine in a child
process holds a prompt's blocks and describes its cache; a decode engine here maps
it and copies the blocks device to device. The tokens must equal a cold run's, and
the copy's bandwidth is printed."""

import json
import subprocess
import sys
import time

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from shared.kv.connectors.memory import MemoryConnector, MemoryKVStore
from shared.kv.connectors.peer import PeerConnector
from shared.kv.transfer import KVTransferParams, PeerSource
from tests.helpers.hf_models import save_tiny_hf_model
from tests.helpers.engine_helpers import run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PREFILL = """
import json, sys, time
from shared.engine.config import EngineConfig
from shared.engine.engine_request import EngineRequest
from shared.engine.llm_engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from shared.kv.connectors.memory import MemoryConnector, MemoryKVStore
from shared.kv.transfer import KVTransferParams

model, prompt, share_dir = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
engine = LLMEngine(EngineConfig(model=model, device="cuda", dtype="float32", block_size=16, kv_lease_timeout_s=60,
                                kv_share_dir=share_dir),
                   kv_connector=MemoryConnector(MemoryKVStore()), share_kv=True)
engine.add_request(EngineRequest("r", prompt, SamplingParams(max_tokens=1, temperature=0.0),
                                 kv_transfer=KVTransferParams(hold=True)))
final = None
while engine.has_unfinished_requests():
    for out in engine.step():
        final = out if out.finished else final
region = engine.runner.kv_region
held = final.kv.held
print(json.dumps({"region": region.share().decode(), "layout": region.layout, "first": final.token_ids,
                  "ids": {str(g): v for g, v in held.block_ids.items()}, "n": held.num_blocks,
                  "deadline": held.deadline}), flush=True)
sys.stdin.readline()  # hold the memory until the test is done
"""



@pytest.mark.parametrize("namespaces", ["one", "pid"])
def test_cuda_ipc_copy_between_processes_equals_a_cold_run(tmp_path, namespaces):
    """one: torch's CUDA IPC handles, both processes in one PID namespace. pid: the prefill
    in a PID namespace of its own (a container), its cache made by CUDA's VMM API and
    handed over a unix socket in a directory both see (kv_share_dir)."""
    # Every layer full attention and wide kv heads, so the copy moves a measurable amount.
    save_tiny_hf_model(
        "qwen2", tmp_path, num_hidden_layers=4, max_position_embeddings=2048, use_sliding_window=False,
        hidden_size=1024, num_attention_heads=8, num_key_value_heads=8, intermediate_size=512,
    )  # fmt: skip
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 500, (1500,), generator=g).tolist()
    share_dir = str(tmp_path / "share") if namespaces == "pid" else ""
    argv = [sys.executable, "-c", PREFILL, str(tmp_path), json.dumps(prompt), share_dir]
    if namespaces == "pid":
        if subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True).returncode:
            pytest.skip("unshare --pid is refused here")
        argv = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", *argv]
    child = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = json.loads(child.stdout.readline())
        released: list[str] = []
        connector = PeerConnector(MemoryConnector(MemoryKVStore()), lambda peer, rid: released.append(rid))
        cfg = dict(model=str(tmp_path), device="cuda", dtype="float32", block_size=16)
        decode = LLMEngine(EngineConfig(**cfg), kv_connector=connector)
        assert json.loads(line["region"])["kind"] == ("cuda_vmm" if namespaces == "pid" else "cuda")
        ids = {int(k): v for k, v in line["ids"].items()}
        source = PeerSource("prefill", line["region"].encode(), ids, line["n"], line["deadline"], line["layout"])
        greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        out = run(decode, "r", prompt, greedy, resume_token_ids=line["first"],
                  kv_transfer=KVTransferParams(load=True, source=source))  # fmt: skip
        elapsed = time.perf_counter() - start
        assert out.kv.loaded_direct and out.kv.num_loaded_blocks == line["n"] == 1500 // 16
        assert released == ["r"]
        cold = run(LLMEngine(EngineConfig(**cfg, enable_prefix_caching=False)), "c", prompt, greedy)
        assert out.token_ids == cold.token_ids
        moved = line["n"] * decode.runner.kv_region.block_bytes
        rate = moved / connector.copy_seconds / 1e9
        print(f"\ndirect copy ({namespaces} PID namespace): {moved / 1e6:.1f} MB of KV in {connector.copy_seconds * 1e3:.2f} ms ({rate:.1f} GB/s); "
              f"decode request incl. copy {elapsed * 1e3:.1f} ms")
    finally:
        child.communicate("\n", timeout=30)


def test_a_mapped_peer_cache_lives_as_long_as_any_view_of_it(tmp_path):
    """kvcache's write-behind child keeps only views of the mapped cache (per_tensor): the
    mapping must outlive the tensors open_peer returned, or reads fault (an illegal address)."""
    import gc

    from shared.kv.memory.region import per_tensor
    from shared.kv.memory.share import CudaVmmAllocator, describe, open_peer

    alloc = CudaVmmAllocator(torch.cuda.current_device(), str(tmp_path))
    owned = alloc((4, 2, 64, 16, 2, 64), torch.bfloat16)
    owned.normal_()
    expected = owned.float().sum().item()
    _, allocations = open_peer(describe([owned], alloc, "x"), torch.device("cuda"))
    views = per_tensor(allocations)
    del allocations
    gc.collect()
    torch.cuda.synchronize()
    assert sum(v.float().sum().item() for v in views) == pytest.approx(expected, rel=1e-3)
    alloc.close()

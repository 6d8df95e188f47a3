"""`benchmarks/gpu_check.sh --dry-run`: the GPU check's whole path on the CPU, with the packages the GPU machine lacks
made unimportable."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.repo import REPO

# Installed as sitecustomize in every Python process of the check (the torchrun one too).
BLOCKER = """
import sys

class _Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("zarr", "numcodecs", "datasets", "vllm"):
            raise ImportError(f"{name} is not installed on the GPU machine")
        return None

sys.meta_path.insert(0, _Missing())
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_the_gpu_check_dry_run_passes_with_torch_alone(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")]),
        "PYTHON": sys.executable,
        "OUT": str(tmp_path / "out"),
    }
    blocked = subprocess.run([sys.executable, "-c", "import zarr"], env=env, capture_output=True, text=True)
    assert "not installed on the GPU machine" in blocked.stderr  # the blocker is in force
    proc = subprocess.run(
        [str(REPO / "benchmarks" / "gpu_check.sh"), "--dry-run"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "gpu_check.jsonl").read_text().splitlines()]
    assert [r["check"] for r in records] == ["environment", *["throughput"] * 4, "smoke", "torchrun", "done"]
    assert proc.stdout.splitlines() == [json.dumps(r) for r in records]
    throughput = {r["config"]: r for r in records if r["check"] == "throughput"}
    assert [c for c, r in throughput.items() if r["compiled"]] == [
        "vit_b16_none_compiled",
        "vit_b16_cross8_before_mlp_compiled",
    ]
    for r in throughput.values():
        assert r["images_per_s"] > 0 and r["gflop_per_step"] > 0 and r["mfu"] is None  # no peak FLOPs on a CPU
    smoke, torchrun, done = records[-3:]
    assert smoke["ok"] and smoke["loss_last"] < smoke["loss_first"] and smoke["steps"] == 30
    assert torchrun["ok"] and torchrun["backend"] == "gloo" and torchrun["fsdp_checkpoint_roundtrip"]
    assert done["ok"]

"""benchmarks/gpu_sweep.sh --cpu-dry: the GPU sweep's every code path on the CPU (the carry packed and
unpacked to the same tokens, the plan of both arms, blocks in ascending N, the budget's cut, the
bundle), and its results re-derived here by `qkvlab compare --render` from the bundle alone."""

import json
import lzma
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_sweep  # noqa: E402


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-sweep-dry")
    env = {**os.environ, "OUT": str(out), "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
    env.pop("QKVLAB_CACHE", None)
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_sweep.sh"), "--cpu-dry"], env=env, capture_output=True, text=True
    )
    return out, done


def test_dry_run_exercises_every_step_and_cuts_by_budget(dry):
    out, done = dry
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    lines = (out / "summary.txt").read_text().splitlines()
    names = [line.split(":")[0] for line in lines]
    assert names[:3] == ["PASS dry-carry", "PASS corpus", "PASS plan"] and names[-1] == "PASS bundle"
    blocks = [line.split(":")[0] for line in lines if "-L" in line.split(":")[0]]
    # the huge d512 does not fit the budget; the depth-4 arm still runs after it
    assert blocks == [
        "PASS gpu-L2 d8-L2",
        "PASS gpu-L2 d16-L2",
        "SKIP gpu-L2 d512-L2",
        "PASS gpu-L4 d8-L4",
        "PASS gpu-L4 d12-L4",
    ]
    record = json.loads((out / "sweep.json").read_text())
    arms = [b["arm"] for b in record["blocks"]]
    assert arms == ["gpu-L2"] * 3 + ["gpu-L4"] * 2  # depth 2 first, then depth 4
    for arm in ("gpu-L2", "gpu-L4"):
        ns = [b["N"] for b in record["blocks"] if b["arm"] == arm]
        assert ns == sorted(ns)  # each arm in ascending N
    ran = [b for b in record["blocks"] if b["state"] == "ran"]
    assert ran[0]["predicted_s"] is None and all(b["predicted_s"] > 0 for b in ran[1:])  # the pace, once measured
    assert {p.name for p in out.iterdir()} == {"summary.txt", "log.txt", "sweep.json", "gpu-sweep.tar.gz"}


def test_the_bundle_alone_renders_both_arms(dry, tmp_path):
    out, _ = dry
    with tarfile.open(out / "gpu-sweep.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    for arm, sizes in (("gpu-L2", 2), ("gpu-L4", 2)):
        folder = tmp_path / arm
        manifest = json.loads((folder / "compare.json").read_text())
        assert manifest["machine"]["train_dtype"] == "bf16"  # one dtype, every size
        assert manifest["metrics"]["lm"]["train_tokens"] > 0 and manifest["metrics"]["lm"]["corpus"]["corpus_sha256"]
        (folder / "results.md").unlink()
        done = subprocess.run(
            [sys.executable, "-m", "qkvlab", "compare", "--render", "--out", str(folder), "--no-plots"],
            env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr
        md = (folder / "results.md").read_text()
        assert f"{sizes} sizes spanning" in md and "epochs of the training split" in md
        assert len(list((folder / "run-logs").glob("*/*/seed*/test.json"))) == sizes * 2 * 2


def test_unpack_refuses_a_corpus_that_is_not_the_packed_one(tmp_path, monkeypatch):
    monkeypatch.setenv("QKVLAB_CACHE", str(tmp_path / "cache"))
    carry = gpu_sweep.dry_carry(tmp_path)
    assert gpu_sweep.unpack(carry, tmp_path / "a", tmp_path / "a-prepared").meta["tokens"]["train"] > 0
    body = json.loads((carry / "carry.json").read_text())
    body["prepared_meta"]["bin_sha256"]["train"] = "0" * 64  # as if a shard had changed on the way
    (carry / "carry.json").write_text(json.dumps(body))
    with pytest.raises(RuntimeError, match="differs from the packed one in bin_sha256"):
        gpu_sweep.unpack(carry, tmp_path / "b", tmp_path / "b-prepared")
    with lzma.open(carry / body["shards"][0], "wb") as f:  # another text: refused before any tokenizing
        f.write(json.dumps({"text": "something else"}).encode() + b"\n")
    with pytest.raises(RuntimeError, match="in corpus_sha256"):
        gpu_sweep.unpack(carry, tmp_path / "c", tmp_path / "c-prepared")
    assert not (tmp_path / "c-prepared").exists()


def test_pace_predicts_from_the_arms_last_block_and_fixed_seconds(tmp_path, monkeypatch):
    """After a block: its seconds per training FLOP (the runs' own step time) for the next block of
    that arm (another arm's last block where this arm has none), plus each run's fixed seconds (wall
    minus training); before any block, no prediction (the first block always runs)."""

    class R:
        def __init__(self, d, steps):
            self.dir, self.cfg = d, type("Cfg", (), {"max_steps": steps})()

    def finished(name: str, elapsed: float) -> R:
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(json.dumps({"step": 100, "elapsed_s": elapsed}) + "\n")
        return R(tmp_path / name, 100)

    monkeypatch.setattr(gpu_sweep, "work_of", lambda runs: sum(r.cfg.max_steps for r in runs) * 1e9)
    pace = gpu_sweep.Pace()
    assert pace.predict([R(None, 10)], "a") is None
    pace.add([finished("a0", 10.0), finished("a1", 10.0)], wall_s=24.0, arm="a")  # 1e-10 s/FLOP, 2 s fixed a run
    assert pace.predict([R(None, 1000)], "a") == pytest.approx(100.0 + 2.0)
    assert pace.predict([R(None, 1000)], "b") == pytest.approx(100.0 + 2.0)  # no b block yet: a's pace
    pace.add([finished("b0", 40.0)], wall_s=42.0, arm="b")  # 4e-10 s/FLOP
    assert pace.predict([R(None, 1000)], "b") == pytest.approx(400.0 + 2.0)
    assert pace.predict([R(None, 1000)], "a") == pytest.approx(100.0 + 2.0)

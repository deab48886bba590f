"""Shared fixtures: the repository, zinc-train beside the module, configs."""
import copy
import json
import os
import pathlib
import subprocess

import pytest

REPO = pathlib.Path(os.environ.get("ZINC_REPO", pathlib.Path(__file__).resolve().parents[2]))


def zinc_train_path():
    """zinc-train of the same build (CTest sets ZINC_TRAIN), else build/tools/zinc-train."""
    p = os.environ.get("ZINC_TRAIN") or str(REPO / "build" / "tools" / "zinc-train")
    return p if os.path.exists(p) else None


def default_doc(steps=20):
    with open(REPO / "configs" / "default.json") as f:
        doc = json.load(f)
    doc["steps_per_print"] = 1
    doc["run"]["steps"] = steps
    return doc


def run_zinc_train(doc, tmp_path, *args, launcher=()):
    """Runs zinc-train --json on doc; returns its events (dicts)."""
    zt = zinc_train_path()
    if zt is None:
        pytest.skip("zinc-train is not built (set ZINC_TRAIN)")
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(doc))
    out = subprocess.run([*launcher, zt, str(cfg), "--json", *args], check=True, capture_output=True, text=True,
                         timeout=600).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.fixture
def doc():
    return copy.deepcopy(default_doc())

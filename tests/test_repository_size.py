"""The repository travels whole to GPU machines (its tracked files, with what a run carries, under one
transfer limit): tracked files stay at most 40 MiB. Weights that only a benchmark needs are trained
on first use instead (ops/train/on_demand.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 40 * 2**20


def tracked_file_sizes(root: Path) -> dict[str, int]:
    """Bytes of every file ``git ls-files`` lists (as ``du -b`` counts them; deleted ones are skipped)."""
    git = shutil.which("git")
    if git is None:
        pytest.fail("git is not installed: the tracked files are what `git ls-files` lists")
    listed = subprocess.run([git, "ls-files", "-z"], cwd=root, capture_output=True, check=False)
    if listed.returncode:
        pytest.fail(f"`git ls-files` failed in {root} (not a git checkout?): {listed.stderr.decode().strip()}")
    sizes = {}
    for name in filter(None, listed.stdout.split(b"\0")):
        path = root / os.fsdecode(name)
        if path.is_symlink() or path.is_file():
            sizes[os.fsdecode(name)] = path.lstat().st_size
    return sizes


def test_tracked_files_fit_in_40_mib() -> None:
    sizes = tracked_file_sizes(ROOT)
    assert len(sizes) > 100, sizes  # the checkout's files, not an empty listing
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:10]
    assert total <= LIMIT_BYTES, (f"tracked files take {total / 2**20:.1f} MiB, over {LIMIT_BYTES / 2**20:.0f} MiB; "
                                  f"largest: " + ", ".join(f"{n} ({s / 2**20:.1f} MiB)" for n, s in largest))

"""ops/cpu/build.py housekeeping that the kernels' users depend on."""

from __future__ import annotations

import os
import time

from backboard.ops.cpu import build


def test_a_stale_build_lock_is_removed_and_a_live_one_kept(tmp_path, monkeypatch):
    """torch waits forever on the lock of a build whose process was killed: an old lock of the
    family goes, a fresh one (a build in progress) and other families' stay."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    locks = {}
    for name, age in (("backboard_fam_avx2_aaaa", 2 * build.STALE_LOCK_S),
                      ("backboard_fam_avx2_bbbb", 10),
                      ("backboard_other_avx2_cccc", 2 * build.STALE_LOCK_S)):
        d = tmp_path / "py311_cpu" / name
        d.mkdir(parents=True)
        locks[name] = d / "lock"
        locks[name].write_text("")
        os.utime(locks[name], (time.time() - age, time.time() - age))
    build._remove_stale_locks("fam", "avx2")
    assert not locks["backboard_fam_avx2_aaaa"].exists()
    assert locks["backboard_fam_avx2_bbbb"].exists()
    assert locks["backboard_other_avx2_cccc"].exists()

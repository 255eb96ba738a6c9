"""A same-size corruption of one rank's fsdp2 (torch.distributed.checkpoint) shard: rank 0 detects it by the
marker's hash, both ranks skip that checkpoint together and resume the previous one, said once; the skipped one is
kept aside, so the resumed run's own step_4 does not replace it."""

from __future__ import annotations

from pathlib import Path

import pytest
from launches import run_worker

pytestmark = pytest.mark.distributed


def test_a_corrupted_shard_is_skipped_by_every_rank(tmp_path: Path, remat_cache: Path) -> None:
    reports = run_worker("corrupt", tmp_path)
    step_4 = tmp_path / "checkpoints" / "step_4"
    for rank, report in enumerate(reports):
        assert report["first"]["steps"] == [1, 2, 3, 4]
        assert Path(report["resumed_from"]) == tmp_path / "checkpoints" / "step_2"
        assert report["resumed"]["steps"] == [3, 4]
        # Same ranks, same shards: steps 3-4 retrained from step_2 reproduce the first run exactly.
        assert report["resumed"]["loss"] == report["first"]["loss"][2:]
        if rank == 1:
            assert report["said"] == []  # rank 0 says it once for all
            continue
        skip, kept = report["said"]
        assert skip.startswith(f"skipping checkpoint {step_4}: dcp/__1_0.distcp: content differs from COMPLETE.json "
                               "(sha256 ") and skip.endswith("...); trying the next newest")
        (aside,) = [p for p in step_4.parent.iterdir() if p.name.startswith(".broken-")]
        assert kept == f"kept the skipped checkpoints step_4, unchanged, in {aside}; latest now names step_2"
        assert (aside / "step_4" / "dcp" / "__1_0.distcp").is_file()


def test_a_file_damaged_on_one_rank_only_falls_back_on_every_rank_without_hanging(tmp_path: Path,
                                                                                   remat_cache: Path) -> None:
    """NOTE [ Ranks agree before the collective load ]: rank 0's rng file garbage, the manifest rewritten to match."""
    reports = run_worker("damaged_rank_file", tmp_path)
    step_4 = tmp_path / "checkpoints" / "step_4"
    for report in reports:
        assert Path(report["resumed_from"]) == tmp_path / "checkpoints" / "step_2"
        assert report["resumed"]["steps"] == [3, 4]
    skip = reports[0]["said"][0]
    assert skip.startswith(f"skipping checkpoint {step_4}: loading failed with RuntimeError: rank 0 could not read its "
                           "files of the checkpoint ("), skip

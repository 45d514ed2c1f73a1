"""A killed job's node-shared cache (``kill -9`` skips the exit clean-up) held its copy in ``/dev/shm`` until
reboot; the next shared cache on the node removes the folders of this user's ended jobs."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

from fastvision.data.cache.datasets import SharedCacheDataset
from fastvision.data.cache.stale import remove_stale_shared


class Items(torch.utils.data.Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        return {"image": torch.full((2,), float(i))}


def _folder(root, name, age_s):
    d = root / name
    d.mkdir()
    (d / "0.fvc").write_bytes(b"x")
    old = time.time() - age_s
    for p in (d / "0.fvc", d):
        os.utime(p, (old, old))
    return d


def test_the_folders_of_ended_jobs_go_and_live_or_recent_ones_stay(tmp_path):
    uid = os.getuid()
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                           text=True, check=True)
    dead = int(ended.stdout)  # a process that has exited: its pid names no process now
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        h = "0123456789abcdef"
        gone = [_folder(tmp_path, f"fastvision-{uid}-p{dead}-{h}-4", 3600),
                _folder(tmp_path, f"fastvision-{uid}-tr{dead}-29500-{h}-4", 3600)]
        kept = [_folder(tmp_path, f"fastvision-{uid}-p{live.pid}-{h}-4", 3600),  # still running
                _folder(tmp_path, f"fastvision-{uid}-p{dead}-{h}-8", 5),  # touched 5 s ago
                _folder(tmp_path, f"fastvision-{uid + 1}-p{dead}-{h}-4", 3600),  # another user's
                _folder(tmp_path, f"fastvision-{uid}-slurm12.0-{h}-4", 3600),  # a SLURM job: not ours to judge
                _folder(tmp_path, f"fastvision-run-{h}-4", 3600)]  # a name of another form
        ds = SharedCacheDataset(Items(), [], name=f"{uid}-p{os.getpid()}", root=tmp_path,
                                local_rank=0, local_world_size=1, num_workers=1, progress=False, cleanup=False)
        assert [p.exists() for p in gone] == [False, False]
        assert all(p.exists() for p in kept) and ds.dir.is_dir()
        assert torch.equal(ds[1]["image"], torch.ones(2))
        assert remove_stale_shared(tmp_path) == []  # nothing more to take
    finally:
        live.kill()
        live.wait()

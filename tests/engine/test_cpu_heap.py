"""``train.cpu_heap``: glibc's malloc keeps freed tensor memory for the next tensor instead of mapping
fresh zeroed pages for each one (page faults counted by the kernel, ``ru_minflt``)."""
from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from fastvision.engine import runtime
from fastvision.errors import ConfigError
from tests.conftest import ROOT, clean_env

# A 40 MB tensor made and freed ten times. Under glibc's defaults a block above 32 MB (the adaptive mmap
# threshold's ceiling) always gets its own mmap, so each round faults its pages in again, whatever the
# process allocated before; kept, the heap serves it from pages it already has after the first round.
PROBE = """
import resource, torch
from fastvision.engine import runtime

def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        x = torch.ones(10 << 20)
        del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

out = [faults()]
for mode in ("system", "keep"):
    out.append(runtime.set_heap(mode))
    faults()  # after keep: the heap grows to hold the tensor, once
    out.append(faults())
print(*out)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_keep_stops_the_page_faults_of_each_new_tensor_and_system_leaves_the_defaults():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=clean_env(), capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    default, system_set, system, keep_set, kept = int(out[0]), out[1], int(out[2]), out[3], int(out[4])
    pages = 10 * (40 << 20) // 4096  # every page of every round's tensor, faulted in again
    assert default > pages // 2 and system > pages // 2, (default, system, pages)  # fresh pages each round
    assert system_set == "False" and keep_set == "True"
    assert kept < pages // 20, (kept, pages)  # kept: the heap serves them from pages it has


def test_an_unknown_mode_names_the_key():
    with pytest.raises(ConfigError, match="train.cpu_heap"):
        runtime.set_heap("fast")

"""One job, one answer: the ranks that share a cache and a torch get the
same members, whatever happens to a layout probe or to the cache's
permissions.

* a probe killed in one rank (the OOM killer, a stray kill) is probed
  again, so that rank gets the members the rank that waited for it gets; a
  rank that cannot get a verdict at all says so;
* a build in a cache the importer cannot write beside (a cluster's
  group-readable cache, another user's build) has its verdict kept in the
  importer's own cache, under the lock, and read there by every later
  import, which does not probe again; concurrent ranks probe under the
  lock.
"""
import ctypes
import json
import os
import signal
import threading
import time


from test_layout_verdict import BACKPORTED, FEATURES, copied_build, needs_extension  # noqa: F401  (copied_build: a fixture)
from _torch_ctxext_build import layout_verdict
from support import start_python

VERIFYING = "verifying that its extension reads the structures"
ALL = {m: "torch_ctxext" for m in BACKPORTED}


def _without_root_powers():
    """In the child, before exec: a root that permissions bind, as they bind
    every other user (capabilities that bypass them dropped from the
    bounding set: the exec'd process has none of them)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2, 3):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER
        libc.prctl(24, capability, 0, 0, 0)  # PR_CAPBSET_DROP


def start(code=FEATURES, bound=False, **env):
    return start_python(code=code, preexec_fn=_without_root_powers if bound and os.geteuid() == 0 else None, **env)


def finish(rank):
    out, err = rank.communicate(timeout=600)
    return rank.returncode, out, err


def features_of(out):
    features = json.loads(out.splitlines()[-1])
    return {m: features[m] for m in BACKPORTED}


def _descends_from(pid, ancestor):
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


# In the probe's command line (the module its process runs).
PROBE = b"_torch_ctxext_build.layout_probe"


class ProbeKiller(threading.Thread):
    """Kills the layout probes started by ``ranks`` (the first ``limit`` of
    them), as the OOM killer would: SIGKILL while it imports torch."""

    def __init__(self, ranks, limit):
        super().__init__(daemon=True)
        self.ranks, self.limit, self.killed, self.stop = ranks, limit, [], False

    def run(self):
        while not self.stop and len(self.killed) < self.limit:
            for entry in os.listdir("/proc"):
                if not entry.isdigit() or int(entry) in self.killed:
                    continue
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        cmdline = f.read()
                except OSError:
                    continue
                pid = int(entry)
                if PROBE in cmdline and any(_descends_from(pid, r.pid) for r in self.ranks):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        continue
                    self.killed.append(pid)
                    if len(self.killed) >= self.limit:
                        return
            time.sleep(0.01)


@needs_extension
def test_the_ranks_of_a_job_agree_when_a_probe_is_killed(copied_build):
    """Two ranks import at once; the first probe is killed. Both get every
    member: the rank whose probe was killed probes again, and says so."""
    cache, _ = copied_build
    ranks = [start(TORCH_CTXEXT_CACHE=cache) for _ in range(2)]
    killer = ProbeKiller(ranks, limit=1)
    killer.start()
    results = [finish(rank) for rank in ranks]
    killer.stop = True
    assert len(killer.killed) == 1
    for status, out, err in results:
        assert status == 0, err
        assert features_of(out) == ALL, err
    said = "".join(err for _, _, err in results)
    assert "the layout probe was killed by SIGKILL; verifying again (2 of 3)" in said


@needs_extension
def test_a_rank_that_cannot_get_a_verdict_says_so(copied_build):
    """Every probe killed: the members that need a verdict are unavailable
    in that rank, with a warning naming why (on main: not a word)."""
    cache, _ = copied_build
    rank = start(TORCH_CTXEXT_CACHE=cache)
    killer = ProbeKiller([rank], limit=3)
    killer.start()
    status, out, err = finish(rank)
    killer.stop = True
    assert status == 0, err
    assert len(killer.killed) == 3
    features = features_of(out)
    assert all(features[m].startswith("unavailable: torch_ctxext could not verify") for m in layout_verdict.NEEDS if m in features)
    assert "ExtensionUnavailableWarning" in err
    assert "the layout probe was killed by SIGKILL, 3 times" in err


@needs_extension
def test_a_build_in_a_cache_the_importer_cannot_write_gets_its_verdict_kept_in_its_own(copied_build, tmp_path):
    """A cluster's shared cache: the build (another user's) and the cache
    are readable, not writable. The verdict is made once, under the lock,
    kept in the importer's own cache, and read there by the next imports."""
    cache, build = copied_build
    own = tmp_path / "home-cache"
    # The lock a process that verified there before left beside the build:
    # it still opens, but no verdict can be written beside it any more.
    (build / (layout_verdict.verdict_name(str(build / "_C.so")) + ".lock")).touch()
    for directory in (build, cache / "builds"):
        directory.chmod(0o555)
    try:
        ranks = [start(bound=True, TORCH_CTXEXT_CACHE=cache, XDG_CACHE_HOME=own) for _ in range(2)]
        results = [finish(rank) for rank in ranks]
        for status, out, err in results:
            assert status == 0, err
            assert features_of(out) == ALL, err
        assert sum(err.count(VERIFYING) for _, _, err in results) == 1, [err for _, _, err in results]
        name = layout_verdict.verdict_name(str(build / "_C.so"))
        kept = own / "torch_ctxext" / "builds" / "layouts" / name
        assert json.loads(kept.read_text())["found"] == {}
        assert list(build.glob("layout-*.json")) == []
        status, out, err = finish(start(bound=True, TORCH_CTXEXT_CACHE=cache, XDG_CACHE_HOME=own))
        assert status == 0 and err == "", err
        assert features_of(out) == ALL
    finally:
        for directory in (build, cache / "builds"):
            directory.chmod(0o755)

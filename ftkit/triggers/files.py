"""Switch files and request files -> requests.

Touching ``JOBDIR/save-switch`` asks for a save at the next step boundary, touching
``JOBDIR/kill-switch`` asks to save and stop for good, and ``ftkit request ...`` drops a
small JSON file into ``JOBDIR/requests/`` (:mod:`ftkit.triggers.switches` owns those files:
names, writing, reading). :class:`SwitchWatcher` watches those paths with watchdog and posts
one :class:`~ftkit.decision.Request` per touch to a :class:`~ftkit.decision.RequestBox`.

inotify does not see changes made on another node of a network filesystem (NFS, Lustre,
GPFS, ...), so in ``auto`` mode the watcher polls when the job directory lives on one.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from dataclasses import dataclass

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers.api import BaseObserver

from .._fs import mount_of
from ..decision import Action, Request, RequestBox, Source
from ..errors import ConfigError
from ..jobdir import JobDir
from .switches import is_request_name, read_request

__all__ = [
    "NETWORK_FSTYPES",
    "SwitchWatcher",
    "WatchConfig",
    "detect_network_fs",
]

log = logging.getLogger(__name__)

_MODES = ("auto", "native", "polling", "off")

#: Filesystem types on which inotify misses changes made from other hosts.
NETWORK_FSTYPES = frozenset(
    {
        "nfs", "nfs4", "lustre", "gpfs", "beegfs", "ceph", "fuse.ceph-fuse", "cifs", "smb3",
        "smbfs", "glusterfs", "fuse.glusterfs", "panfs", "wekafs", "fuse.sshfs", "afs",
        "orangefs", "pvfs2", "cvfs", "fuse.juicefs", "fuse.s3fs", "fuse.gcsfuse",
        "fuse.lizardfs", "fuse.moosefs", "fuse.mfs",
    }
)  # fmt: skip

# Changes to the same file (same inode) less than this apart in mtime are one touch:
# `touch` creates the file and then sets its times, `echo > f` creates and then writes,
# and a watcher thread may look in between. A touch a second or more later posts again.
_SAME_TOUCH_NS = 1_000_000_000
_HANDLED_EVENTS = frozenset({"created", "modified", "moved", "closed", "attrib"})


@dataclass(kw_only=True, slots=True)
class WatchConfig:
    """How the switch files and request files of a job directory are watched."""

    mode: str = "auto"
    """``auto`` (poll on network filesystems, inotify elsewhere), ``native`` (always the
    platform observer), ``polling`` (always poll) or ``off`` (ignore switch files)."""

    poll_interval: float = 1.0
    """Seconds between two scans of the job directory when polling (> 0)."""

    def __post_init__(self) -> None:
        if not isinstance(self.mode, str) or self.mode not in _MODES:
            raise ConfigError(f"watch.mode: got {self.mode!r}; use one of {', '.join(_MODES)}")
        interval = self.poll_interval
        if isinstance(interval, bool) or not isinstance(interval, (int, float)):
            raise ConfigError(
                f"watch.poll_interval: got {interval!r}; give seconds as a number > 0"
            )
        if not (0 < interval < float("inf")):
            raise ConfigError(
                f"watch.poll_interval: got {interval!r}; give a positive number of seconds, e.g. 1.0"
            )
        self.poll_interval = float(interval)


# --------------------------------------------------------------------------------------
# network filesystem detection


def detect_network_fs(
    path: str | os.PathLike[str], *, mounts: str | os.PathLike[str] = "/proc/self/mounts"
) -> str | None:
    """The fstype of the network/cluster filesystem holding ``path``, else None (local, or the
    mount table ``mounts`` cannot be read: not Linux). See :func:`ftkit._fs.mount_of`."""
    mount = mount_of(path, mounts=mounts)
    if mount is None:
        return None
    return mount.fstype if mount.fstype.lower() in NETWORK_FSTYPES else None


# --------------------------------------------------------------------------------------
# the watcher


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def _switch_request(source: Source, path: str) -> Request:
    if source is Source.SAVE_SWITCH:
        return Request(
            Action.SAVE, source, reason=f"save-switch touched ({path})", pin=True, origin=path
        )
    return Request(
        Action.SAVE_EXIT,
        source,
        reason=f"kill-switch touched ({path})",
        requeue=False,
        pin=True,
        origin=path,
    )


class SwitchWatcher:
    """Watches a job directory's switch files and request files; posts requests.

    Use as a context manager (``with SwitchWatcher(jd, box, cfg): ...``) or call
    :meth:`start` / :meth:`close`. Files already present at start post too (a switch
    touched while the job was queued is honoured). Each file posts once per touch, however
    many events the observer delivers: posts are keyed by (inode, mtime_ns, size).
    """

    def __init__(
        self,
        job_dir: JobDir,
        box: RequestBox,
        config: WatchConfig | None = None,
        *,
        mounts: str | os.PathLike[str] = "/proc/self/mounts",
        run: tuple[str | None, int] | None = None,
    ) -> None:
        self.job_dir = job_dir
        self.box = box
        self.run = run
        """``(SLURM job id, restart count)`` of this run: a request written for another run
        (``ftkit request --this-run`` in a signal trap) is discarded, not acted on. None: all act."""
        self.config = config if config is not None else WatchConfig()
        self.network_fs: str | None = None
        self._why: str
        mode = self.config.mode
        if mode == "off":
            self.observer_kind, self._why = "off", "watch.mode=off"
        elif mode in ("native", "polling"):
            self.observer_kind, self._why = mode, f"watch.mode={mode}"
            self.network_fs = detect_network_fs(job_dir.root, mounts=mounts)
        else:
            self.network_fs = detect_network_fs(job_dir.root, mounts=mounts)
            if self.network_fs:
                self.observer_kind = "polling"
                self._why = f"{job_dir.root} is on {self.network_fs}, inotify misses remote changes"
            else:
                self.observer_kind, self._why = "native", f"{job_dir.root} is on a local filesystem"
        self._observer: BaseObserver | None = None
        self._lock = threading.RLock()
        self._seen: dict[str, tuple[int, int, int]] = {}  # last identity looked at
        self._posted: dict[str, tuple[int, int]] = {}  # (inode, mtime_ns) last posted
        self._warned: set[object] = set()
        self._switches = {
            os.path.normpath(job_dir.save_switch): Source.SAVE_SWITCH,
            os.path.normpath(job_dir.kill_switch): Source.KILL_SWITCH,
        }
        self._requests_dir = os.path.normpath(job_dir.requests)

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> SwitchWatcher:
        if self._observer is not None or self.observer_kind == "off":
            if self.observer_kind == "off":
                log.info("switch files are not watched (%s)", self._why)
            return self
        self.job_dir.ensure()
        try:
            self._observer = self._start_observer(self.observer_kind)
        except OSError as exc:  # e.g. the inotify watch limit is reached
            if self.observer_kind != "native":
                raise
            log.warning(
                "cannot start the native file observer (%s); polling %s every %.3g s instead",
                exc,
                self.job_dir.root,
                self.config.poll_interval,
            )
            self.observer_kind, self._why = "polling", f"native observer failed: {exc}"
            self._observer = self._start_observer("polling")
        if self.observer_kind == "polling":
            log.info(
                "watching %s by polling every %.3g s (%s)",
                self.job_dir.root,
                self.config.poll_interval,
                self._why,
            )
        elif self.network_fs:
            log.warning(
                "watching %s with the native observer although it is on %s: touches from "
                "other hosts may go unseen; set watch.mode to auto or polling",
                self.job_dir.root,
                self.network_fs,
            )
        else:
            log.info("watching %s with the native observer (%s)", self.job_dir.root, self._why)
        # The observers took their first snapshot / added their watches synchronously in
        # start(), so a file created from now on is seen by one of the two paths (or both;
        # the identity check drops the duplicate).
        self._scan()
        return self

    def _start_observer(self, kind: str) -> BaseObserver:
        observer: BaseObserver
        if kind == "polling":
            from watchdog.observers.polling import PollingObserver

            observer = PollingObserver(timeout=self.config.poll_interval)
        else:
            from watchdog.observers import Observer

            _quiet_inotify_stop_race()
            observer = Observer()
        handler = _Handler(self)
        observer.schedule(handler, str(self.job_dir.root), recursive=False)
        observer.schedule(handler, self._requests_dir, recursive=False)
        try:
            observer.start()
        except BaseException:
            observer.stop()
            raise
        return observer

    def close(self) -> None:
        observer, self._observer = self._observer, None
        if observer is None:
            return
        observer.stop()
        if observer.is_alive():
            observer.join(timeout=max(5.0, 3 * self.config.poll_interval))
            if observer.is_alive():  # a stat stuck on a dead network mount; it is a daemon
                log.warning("file observer for %s did not stop in time", self.job_dir.root)

    def __enter__(self) -> SwitchWatcher:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- event handling (observer thread, and the caller's thread for the first scan) --

    def _scan(self) -> None:
        for path in self._switches:
            self._consider(path)
        try:
            entries = sorted(os.listdir(self._requests_dir))
        except OSError as exc:
            log.warning("cannot list %s: %s", self._requests_dir, exc)
            return
        for name in entries:
            self._consider(os.path.join(self._requests_dir, name))

    def _on_event(self, event: FileSystemEvent) -> None:
        kind = event.event_type
        if kind not in _HANDLED_EVENTS and kind != "deleted":
            return
        src = os.path.normpath(os.fsdecode(event.src_path))
        if kind in ("deleted", "moved"):
            with self._lock:
                self._seen.pop(src, None)
                self._posted.pop(src, None)
        if kind == "moved":
            self._consider(os.path.normpath(os.fsdecode(event.dest_path)))
        elif kind != "deleted":
            self._consider(src)

    def _consider(self, path: str) -> None:
        """Post the request behind ``path`` if it names a switch/request file not yet seen."""
        switch = self._switches.get(path)
        if switch is None:
            parent, name = os.path.split(path)
            if parent != self._requests_dir or not is_request_name(name):
                return
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            self._warn_once(("stat", path), "cannot stat %s: %s", path, exc)
            return
        if not stat.S_ISREG(st.st_mode):
            self._warn_once(
                ("type", path, st.st_ino),
                "ignoring %s: not a regular file (symlinks and directories do not count)",
                path,
            )
            return
        ident = _identity(st)
        with self._lock:  # held while reading: only the first scan ever contends
            if self._seen.get(path) == ident:
                return
            self._seen[path] = ident
            posted = self._posted.get(path)
            if (
                posted is not None
                and posted[0] == st.st_ino
                and abs(st.st_mtime_ns - posted[1]) < _SAME_TOUCH_NS
            ):
                return  # the tail of a touch already posted (create, then set times/write)
            if switch is not None:
                request: Request | None = _switch_request(switch, path)
            elif st.st_size == 0:
                return  # being written by a non-atomic writer; the write brings another event
            else:
                request = self._read_request(path, ident)
            if request is None:
                return
            self._posted[path] = (st.st_ino, st.st_mtime_ns)
        log.info("%s -> %s", path, request.reason)
        self.box.post(request)

    def _read_request(self, path: str, ident: tuple[int, int, int]) -> Request | None:
        try:
            found = read_request(path)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:  # ConfigError and JSONDecodeError are ValueErrors
            self._warn_once(("parse", path, ident), "ignoring request file %s: %s", path, exc)
            return None
        stale = None if self.run is None else found.stale_for(*self.run)
        if stale is not None:
            self._warn_once(("stale", path, ident), "ignoring and removing request file %s (%s): %s", path,
                            found.describe(), stale)
            try:
                os.unlink(path)
            except FileNotFoundError:  # another rank's watcher was first
                pass
            except OSError as exc:
                self._warn_once(("unlink", path), "cannot remove %s: %s", path, exc)
            return None
        return Request(found.action, Source.REQUEST, reason=f"{found.describe()} ({path})",
                       requeue=found.requeue, origin=path)

    def _warn_once(self, key: object, msg: str, *args: object) -> None:
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        log.warning(msg, *args)


class _StopRaceFilter(logging.Filter):
    """watchdog 7 logs an ERROR when an event arrives while its inotify thread is stopping
    (an event for the events log, say). Nothing is lost: we are closing. Drop just that line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "called when the thread is inactive" not in record.getMessage()


def _quiet_inotify_stop_race() -> None:
    target = logging.getLogger("watchdog.observers.inotify")
    if not any(isinstance(f, _StopRaceFilter) for f in target.filters):
        target.addFilter(_StopRaceFilter())


class _Handler(FileSystemEventHandler):
    """Forwards watchdog events to the watcher; an exception is logged, never raised."""

    def __init__(self, watcher: SwitchWatcher) -> None:
        super().__init__()
        self._watcher = watcher

    def dispatch(self, event: FileSystemEvent) -> None:
        try:
            self._watcher._on_event(event)
        except Exception:
            log.exception("switch watcher: error while handling %s", event)

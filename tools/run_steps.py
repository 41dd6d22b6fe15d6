"""The steps of tools/run.py: commands run with their output kept, timed, one or two at a time.

A step is a title and a function. :meth:`Steps.run` prints ``== title``,
runs it, and prints what it returned (the lines a reader needs: a summary,
a verdict) and its time; a command that fails stops the job with its whole
output printed. :meth:`Steps.together` runs independent steps side by side
(this machine has two cores, and most steps keep one busy), each one's output
printed in order once it is done. :class:`Background` prepares what later
steps need (virtual environments: mostly downloads) while steps run.

Standard library only, Python 3.8 and newer: it runs before any virtual
environment exists.
"""
import glob
import os
import subprocess
import sys
import threading
import time


class Failed(Exception):
    """A command failed; the message holds what it printed."""


def find_test(root, name):
    """The path of ``test/**/name`` (a test file, by its basename wherever it lies under test/)."""
    found = sorted(glob.glob(os.path.join(root, "test", "**", name), recursive=True))
    if len(found) != 1:
        raise Failed(f"test/**/{name}: {len(found)} files found, expected one")
    return found[0]


def command(args, env=None, log=None, cwd=None):
    """Run ``args`` (a list) with ``env`` added to this process's environment
    (a value of None removes that variable); its output goes to ``log`` (a
    path) when given, else to this process's. Raise :class:`Failed` (with the
    log's text) when it exits non-zero; return the log's text, or ''."""
    environment = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            environment.pop(key, None)
        else:
            environment[key] = value
    args = [str(a) for a in args]
    if log is None:
        sys.stdout.flush()
        if _wait(subprocess.Popen(args, env=environment, cwd=cwd)) != 0:
            raise Failed(f"failed: {' '.join(args)}")
        return ""
    with open(log, "w") as f:
        returncode = _wait(subprocess.Popen(args, env=environment, cwd=cwd, stdout=f, stderr=subprocess.STDOUT))
    with open(log, errors="replace") as f:
        text = f.read()
    if returncode != 0:
        raise Failed(f"{text}\nexit {returncode}: {' '.join(args)} (log: {log})")
    return text


_running = set()  # the commands running now, in every thread
_running_lock = threading.Lock()


def _wait(process):
    with _running_lock:
        _running.add(process)
    try:
        return process.wait()
    finally:
        with _running_lock:
            _running.discard(process)


def stop_all():
    """Stop the commands still running (a job that fails leaves no download behind)."""
    with _running_lock:
        processes = list(_running)
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def last_lines(text, count=1):
    """The last ``count`` non-empty lines of ``text``, as one string."""
    lines = [line for line in text.splitlines() if line.strip()]
    return "\n".join(lines[-count:])


def from_line(text, start):
    """``text`` from its first line that starts with ``start`` (all of it when none does)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(start):
            return "\n".join(lines[i:])
    return text


def _short(title, width=100):
    """A step's title in one summary line: what follows its last colon is the
    release or the interpreter it ran on, kept whole."""
    if len(title) <= width or ": " not in title:
        return title
    head, tail = title.rsplit(": ", 1)
    return head[:max(20, width - len(tail) - 5)] + "...: " + tail


def _minutes(seconds):
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


class Steps:
    """Runs and times a job's steps; :meth:`summary` lists each step's time."""

    def __init__(self):
        self.start = time.monotonic()
        self.times = []  # (title, seconds)
        self._print = threading.Lock()

    def _say(self, text):
        with self._print:
            print(text, flush=True)

    def run(self, title, function, *args):
        """Run ``function(*args)`` as the step ``title``; return what it returned."""
        self._say(f"== {title}")
        t0 = time.monotonic()
        result = function(*args)
        self._done(title, result, time.monotonic() - t0)
        return result

    def _done(self, title, result, seconds):
        self.times.append((title, seconds))
        if isinstance(result, tuple):  # (what to print, what the job goes on with)
            result = result[0]
        text = result if isinstance(result, str) else ""
        self._say((text + "\n" if text.strip() else "") + f"   ({_minutes(seconds)}: {_short(title)})")

    def together(self, *steps):
        """Run the steps (title, function, *args) side by side; each one's
        output is printed in order once it and those before it are done. The
        first failure is raised once all have finished."""
        results = [None] * len(steps)

        def one(i, step):
            t0 = time.monotonic()
            try:
                results[i] = ("ok", step[1](*step[2:]), time.monotonic() - t0)
            except BaseException as error:  # reported below, in order
                results[i] = ("failed", error, time.monotonic() - t0)

        threads = [threading.Thread(target=one, args=(i, step), daemon=True) for i, step in enumerate(steps)]
        for thread in threads:
            thread.start()
        failure = None
        for thread, step, i in zip(threads, steps, range(len(steps))):
            thread.join()
            status, value, seconds = results[i]
            self._say(f"== {step[0]}")
            if status == "ok":
                self._done(step[0], value, seconds)
            elif failure is None:
                failure = value
        if failure is not None:
            raise failure
        return [r[1] for r in results]

    def summary(self, job):
        lines = [f"== {job}: {_minutes(time.monotonic() - self.start)} in all; each step:"]
        for title, seconds in self.times:
            lines.append(f"   {_minutes(seconds):>6}  {_short(title)}")
        self._say("\n".join(lines))


class Background:
    """Tasks run in the background, at most ``workers`` at a time, in the
    order given; each one's output goes to ``out/<name>.log``. :meth:`wait`
    blocks until a task is done and raises :class:`Failed` (its log) if it
    failed. Tasks are functions taking the log's path."""

    def __init__(self, out, workers=2):
        self.out = out
        self._tasks = {}
        self._queue = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._work, daemon=True) for _ in range(workers)]
        self._started = False

    def submit(self, name, function):
        entry = {"function": function, "done": threading.Event(), "error": None, "result": None, "seconds": 0.0,
                 "log": os.path.join(self.out, name.replace(" ", "-") + ".log")}
        assert not self._started, "every task is submitted before start()"
        self._tasks[name] = entry
        self._queue.append(name)

    def start(self):
        self._started = True
        for thread in self._threads:
            thread.start()

    def _work(self):
        while True:
            with self._lock:
                if not self._queue:
                    return
                name = self._queue.pop(0)
                entry = self._tasks[name]
            t0 = time.monotonic()
            try:
                entry["result"] = entry["function"](entry["log"])
            except BaseException as error:
                entry["error"] = error
            entry["seconds"] = time.monotonic() - t0
            entry["done"].set()

    def has(self, name):
        return name in self._tasks

    def wait(self, name):
        """Wait for the task ``name``; return what it returned."""
        entry = self._tasks[name]
        entry["done"].wait()
        if entry["error"] is not None:
            raise Failed(f"{name} failed: {entry['error']}")
        return entry["result"]

    def seconds(self, name):
        """How long the finished task ``name`` ran."""
        return self._tasks[name]["seconds"]

"""Killing a training run with everything it started. Standard library only: the watchdog loads this file
by its path, without importing dash_plugin (and torch) at the moment it must act.

A run is started in a session of its own, so killing its process group stops a plain `python` run and
most launchers. PyTorch's elastic launcher (torchrun, `accelerate launch --multi_gpu`) starts each
worker in a session of its own, though: those workers are not in the run's group, and once their
launcher is dead they are re-parented and no longer its descendants. So the whole tree is collected
first, while it is still connected, and then killed."""
import os
import signal


def _children_by_parent() -> dict:
    """{parent pid: [child pids]} from /proc (empty where there is no /proc)."""
    children = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return children
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:   # gone meanwhile
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses, so split after its last ')'
        fields = stat[stat.rfind(b")") + 2:].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def descendants(pid: int) -> list:
    """Every process below `pid`, at any depth."""
    children, found, todo = _children_by_parent(), [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL the process group `pid` leads and every descendant of `pid` (also those in sessions of
    their own), the descendants collected before anything is killed."""
    kills = [(os.killpg, pid)] + [(os.kill, child) for child in descendants(pid)]
    for kill, target in kills:
        try:
            kill(target, signal.SIGKILL)
        except OSError:   # gone already
            pass

"""Starting and stopping runner processes: each in its own process group, so nothing is left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil

from shardline.compute import blas
from shardline.instance.spec import RunnerSpec
from shardline.trust.credentials import KEY_ENV, TLS_ENV, Credentials


def spawn_runner(spec: RunnerSpec, threads: int, credentials: Credentials | None = None) -> subprocess.Popen:
    """Start a runner in its own session (process group); its stdout and stderr come back on one pipe. The
    node's credentials reach it in its environment (readable by its owner only), never on its command line."""
    env = {k: v for k, v in blas.runner_env(threads).items() if k not in (KEY_ENV, TLS_ENV)}
    env.update((credentials or Credentials()).env())  # exactly the node's: an inherited variable never counts
    return subprocess.Popen(
        [sys.executable, "-m", "shardline.runner", spec.model_dump_json()],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal the runner's whole process group (it leads its own session)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_runners(procs: list[subprocess.Popen], grace: float) -> None:
    """Wait up to `grace` seconds for a clean exit, then SIGKILL the groups and reap them."""
    watched = []
    for p in procs:
        if p.poll() is None:
            try:
                watched.append(psutil.Process(p.pid))
            except psutil.NoSuchProcess:
                pass  # exited between the two looks
    if grace > 0 and watched:
        psutil.wait_procs(watched, timeout=grace)
    for p in procs:
        kill_group(p)  # also reaches anything the runner started in its group
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            kill_group(p)
            p.wait()

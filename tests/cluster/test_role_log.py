"""A role's log file: its lines appended, and a disk that cannot take them (full, read-only) said once, never raised:
the launcher keeps draining the role's output, or the role would block on a full pipe."""

from __future__ import annotations

import errno
import os
from typing import Any

from shardflow.cluster.role_log import RoleLog


def test_lines_are_appended_to_the_roles_log(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "worker_0.log").write_text("earlier run\n")
    with RoleLog(tmp_path / "logs", "worker:0", say=print) as log:
        log.write("step 1\n")
    assert (tmp_path / "logs" / "worker_0.log").read_text() == "earlier run\nstep 1\n"


def test_a_full_disk_is_said_once_and_the_lines_after_it_are_tried_again(tmp_path, monkeypatch):
    said: list[str] = []
    real_write = os.write
    full = True

    def write(fd: int, data: Any) -> int:
        if full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    with RoleLog(tmp_path, "ps:1", say=said.append) as log:
        log.write("lost\n")
        log.write("lost too\n")
        full = False
        log.write("written\n")
    (line,) = said
    assert line.startswith(f"cannot write ps:1's log {tmp_path / 'ps_1.log'}: [Errno 28] No space left on device")
    assert (tmp_path / "ps_1.log").read_text() == "written\n"

"""The launcher refuses a temporary folder whose forkserver socket path would be too long.

multiprocessing's forkserver listens on a Unix socket at ``<its folder>/listener-XXXXXXXX``,
its folder made inside ``TMPDIR``; a path longer than the system's ``sun_path`` (107 bytes
on Linux) failed deep inside multiprocessing with ``OSError: AF_UNIX path too long`` (seen
when pytest-xdist's per-worker folders were the TMPDIR of a train_4d run). The launcher now
says which folder, how long, the limit and the fix, before anything starts. Pure: nothing
starts here (tests/unit's conftest would refuse it).
"""
import os

import pytest
from multiprocessing import util

from tutorial_lib import launch
from tutorial_lib.config import ConfigError

NAME = len("/listener-") + 8  # what the forkserver adds to its folder's path


def test_a_folder_whose_socket_path_fits_exactly_passes():
    folder = "/" + "d" * (launch.UNIX_SOCKET_PATH_MAX - NAME - 1)
    assert len(os.path.join(folder, "listener-12345678")) == launch.UNIX_SOCKET_PATH_MAX
    assert launch.forkserver_socket_problem(folder) is None


def test_one_byte_more_is_refused_with_the_length_the_limit_and_the_fix():
    folder = "/" + "d" * (launch.UNIX_SOCKET_PATH_MAX - NAME)
    problem = launch.forkserver_socket_problem(folder)
    assert problem is not None
    assert folder in problem
    assert f"{launch.UNIX_SOCKET_PATH_MAX + 1} bytes" in problem
    assert f"at most {launch.UNIX_SOCKET_PATH_MAX}" in problem
    assert "TMPDIR=/tmp" in problem


def test_the_launcher_refuses_before_starting_the_forkserver(monkeypatch):
    long_folder = "/tmp/" + "x" * 120
    monkeypatch.setattr(util, "get_temp_dir", lambda: long_folder)
    with pytest.raises(ConfigError) as refused:
        launch._ensure_forkserver()
    assert refused.value.rule == "temporary folder"
    assert long_folder in str(refused.value)

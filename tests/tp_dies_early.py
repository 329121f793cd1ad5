"""A follower function whose module ends the rank process as the rank imports it (tests/test_tp_model.py):
a rank that dies before it joins its group, as one whose imports or device fail would."""

import multiprocessing
import os

if multiprocessing.current_process().name.startswith("mlora-tp-rank-"):
    os._exit(7)


def never_runs(collective):
    raise AssertionError("the rank process ends before it runs this")

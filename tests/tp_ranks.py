"""Rank functions for the process-group tests (tests/test_tp_model.py), in a module of their own so
that a spawned rank imports torch and mlora's process group only, not a test module's imports."""

import os
import time

import torch


def die_or_fail_or_sum(collective, victim: int, failing: int):
    """Rank ``victim`` exits at once, rank ``failing`` raises; the others sum with them."""
    t = torch.ones(4)
    collective.all_reduce(t)
    if collective.layout.rank == victim:
        os._exit(3)
    if collective.layout.rank == failing:
        raise ValueError("this rank's own failure")
    collective.all_reduce(t)  # a peer is gone: E_TP_PEER_LOST
    return t


def sleep_or_sum(collective, sleeper: int):
    """Rank ``sleeper`` stops answering for a minute; the others sum with it."""
    t = torch.ones(4)
    collective.all_reduce(t)
    if collective.layout.rank == sleeper:
        time.sleep(60)
    collective.all_reduce(t)
    return t

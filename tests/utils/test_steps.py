"""Visible long steps: a step or a block that runs long shows how long it has run; quiet ones print nothing."""
from __future__ import annotations

import time

from kiln.utils.steps import StepLog, ticking


def test_a_long_block_shows_its_running_time(capsys):
    with ticking("Reading metadata", after_s=0.05, every_s=0.2):
        time.sleep(1.3)
    err = capsys.readouterr().err
    assert "Reading metadata 00:01" in err


def test_short_and_quiet_blocks_print_nothing(capsys):
    with ticking("Short", after_s=0.5):
        pass
    with ticking("Quiet", quiet=True, after_s=0.0):
        time.sleep(0.1)
    assert capsys.readouterr().err == ""


def test_steps_print_their_names_and_times(capsys):
    log = StepLog("Load", 2)
    with log.step("Read the config"):
        pass
    with log.step("Load the weights"):
        pass
    log.done()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "Load [1/2] Read the config" and lines[1].startswith("Load [1/2] done in ")
    assert lines[2] == "Load [2/2] Load the weights" and lines[4].startswith("Load done in ")

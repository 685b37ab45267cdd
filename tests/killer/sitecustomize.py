"""Imported by Python at the start of every process a fault-injection test starts (tests/faults.py)."""

import kill_after_step

kill_after_step.install()

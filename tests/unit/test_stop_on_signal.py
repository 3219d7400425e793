"""grpo.StopOnSignal (``daedalus run``'s Ctrl-C and SIGTERM, ``daedalus train``'s SIGTERM) against a real
ControlState, with real signals sent to this process (Python runs the handler on the main thread, where pytest runs
the test, at the next bytecode after ``os.kill``)."""

from __future__ import annotations

import os
import signal

import pytest

from daedalus_trainer.grpo import SIGTERM_EXIT, stop_on_sigint, stop_on_sigterm
from daedalus_trainer.server import ControlState


def _training() -> ControlState:
    control = ControlState(total_steps=10)
    control.set_status(phase="training", step=3)
    return control


def test_first_ctrl_c_asks_for_a_stop_and_the_second_interrupts():
    control = _training()
    before = signal.getsignal(signal.SIGINT)
    with stop_on_sigint(control) as ctrl_c:
        assert signal.getsignal(signal.SIGINT) is not before
        os.kill(os.getpid(), signal.SIGINT)
        assert ctrl_c.received and control.stop_requested()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before  # restored on leaving


def test_ctrl_c_with_a_stop_already_pending_interrupts_at_once():
    control = _training()
    control.request_checkpoint(stop=True)  # POST /stop
    with stop_on_sigint(control) as ctrl_c:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert not ctrl_c.received


def test_sigterm_stops_then_exits_143_and_exits_0_once_the_run_has_ended():
    control = _training()
    with stop_on_sigterm(control) as sigterm:
        os.kill(os.getpid(), signal.SIGTERM)
        assert sigterm.received and control.stop_requested()
        with pytest.raises(SystemExit) as again:
            os.kill(os.getpid(), signal.SIGTERM)
    assert again.value.code == SIGTERM_EXIT == 143

    finished = ControlState(total_steps=10)
    finished.set_status(phase="finished", step=10)
    with stop_on_sigterm(finished) as sigterm:
        with pytest.raises(SystemExit) as ended:
            os.kill(os.getpid(), signal.SIGTERM)
    assert ended.value.code == 0 and not sigterm.received


@pytest.mark.timeout(30, method="thread")  # with a plain Lock this test deadlocks: fail it rather than hang
def test_a_request_made_while_the_main_thread_holds_the_control_lock_does_not_deadlock():
    """The handler may run while the main thread is inside a ControlState method (holding its lock)."""
    control = _training()
    with stop_on_sigint(control) as ctrl_c:
        with control._cond:  # as set_status holds it
            os.kill(os.getpid(), signal.SIGINT)
        assert ctrl_c.received and control.stop_requested()

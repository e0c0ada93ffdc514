"""launch.local turns SIGTERM into the same orderly stop as Ctrl-C (roles are not orphaned)."""

import os
import signal

import pytest

from launch.run.local import on_sigterm_interrupt


def test_sigterm_raises_keyboard_interrupt_so_the_roles_are_stopped():
    previous = signal.getsignal(signal.SIGTERM)
    try:
        on_sigterm_interrupt()
        with pytest.raises(KeyboardInterrupt, match="signal 15"):
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 0)  # a signal is handled between bytecodes: give it one
    finally:
        signal.signal(signal.SIGTERM, previous)

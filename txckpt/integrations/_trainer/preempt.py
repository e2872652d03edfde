"""``txckpt_save_on_preemption``: SIGTERM or SIGUSR1 make the Trainer save at its next step
boundary, stop, and the process exit (docs/preemption.md, "The Trainer").

:class:`PreemptionSave` is one Trainer's: ``begin()`` (train() starts) installs
``txckpt.preemption``'s handlers unless the script did; at each step's end, on every rank, its
callback asks ``txckpt.preemption.requested()`` (one all-reduce inside a process group, so every
rank answers the same at the same step) and, once True, sets ``control.should_save`` and
``control.should_training_stop``: the Trainer saves that step as any other (a transaction, sync
or async), then leaves its loop. ``end()`` (train() returned) calls ``txckpt.preemption.exit()``:
the pending saves finish within the grace, what committed is logged, and SystemExit carries 128
+ the signal's number to the scheduler.

The checkpoint records ``should_training_stop`` in its control state, as upstream's final
checkpoint of every run does; a resumed run goes on all the same (tests/test_trainer_preempt.py
resumes with ``restore_callback_states_from_checkpoint=True``, which restores that state).
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

from txckpt import preemption

log = logging.getLogger("txckpt.transformers")


class _SaveAndStop(TrainerCallback):
    def __init__(self) -> None:
        self.step: int | None = None  # the step the preemption saves

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.step is None and preemption.requested():  # every rank, every step: one collective
            self.step = int(state.global_step)
            control.should_save = control.should_training_stop = True
            log.warning(
                "txckpt: preemption: saving step %d, then training stops and the process exits with status %d",
                self.step,
                preemption.exit_status(),
            )
        return control


class PreemptionSave:
    """One Trainer's ``txckpt_save_on_preemption`` (see the module doc)."""

    def __init__(self, trainer: Any, grace_s: float | None):
        self._grace_s = grace_s
        self._callback = _SaveAndStop()
        self._installed_here = False
        self._committed: str | None = None  # the preemption's step's checkpoint, once committed
        trainer.add_callback(self._callback)

    def begin(self) -> None:
        self._callback.step = None
        self._committed = None
        if not preemption.installed():
            preemption.install(grace_s=self._grace_s)
            self._installed_here = True

    def committed(self, step: int, path: str) -> None:
        """The Trainer committed ``path`` (a synchronous save after its transaction; an async
        one once the Trainer settled it): the preemption's own save, if it is that step, is
        remembered for the exit's log line. ``preemption.exit`` reports only the async saves
        still unreported when it runs, and the Trainer has settled (reported) its own by then."""
        if self._callback.step is not None and step == self._callback.step:
            self._committed = path

    def end(self, *, completed: bool) -> None:
        """After train(): a preempted run that saved exits (``preemption.exit``); otherwise the
        handlers this object installed are put back."""
        try:
            if completed and self._callback.step is not None:
                if self._committed is not None:
                    log.warning(
                        "txckpt: preemption (exit): committed %s (step %d)", self._committed, self._callback.step
                    )
                preemption.exit()  # raises SystemExit(128 + signum)
        finally:
            if self._installed_here:
                self._installed_here = False
                preemption.uninstall()


def note_committed(trainer: Any, step: int, path: str) -> None:
    """The Trainer committed checkpoint ``step`` at ``path``: tell its PreemptionSave, if any."""
    preempt = getattr(trainer, "_txckpt_preempt", None)
    if preempt is not None:
        preempt.committed(step, path)


__all__ = ["PreemptionSave", "note_committed"]

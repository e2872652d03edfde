"""An accelerate loop resumed mid-epoch continues as if it had never stopped (issue 32).

Why stock accelerate diverges: ``load_state`` restores the RNGs as they were at the saved step,
and only then does the loop make the epoch's iterator (``skip_first_batches(dataloader, done)``).
Making it draws from the global torch generator what the uninterrupted run drew at the epoch's
*start*: the DataLoader's base seed (the workers' seeds) and, for a ``shuffle=True`` loader on
one process, the shuffle's seed. So the resumed epoch's order is not the one the run trained on,
and every dropout draw after it is shifted. On more than one process accelerate gives the
sampler a generator of its own (seeded once, in ``prepare``) that advances every epoch;
``save_state`` does not save it, so a resume in a later epoch replays the first epoch's order.
(tests/test_resume_equivalence_accelerate.py measures both with stock ``Accelerator``.)

The fix, per prepared ``DataLoaderShard`` (and each ``acc.skip_first_batches`` copy of it):

* at the start of each iteration, before the iterator draws anything, record the torch RNG
  state, the state of each generator the loader's sampling uses, and accelerate's epoch counter
  (``iteration``);
* ``save_state`` writes, per process, ``txckpt_epoch_start_<process>.pt``: for each prepared
  loader, whether it was mid-epoch and, if so, those epoch-start states;
* ``load_state`` (after accelerate restored the step's RNGs) reads it back; the next iteration
  of that loader starts from the epoch-start states, so it draws the same order and seeds, and
  once it has produced its first batch (those draws done) the step's torch RNG state is put
  back: the next dropout mask is the one the uninterrupted run drew.

A loader that was between epochs at the save (its last batch yielded) needs nothing: the next
epoch draws from the restored state, as the uninterrupted run did. A skip copy that finishes its
epoch passes its epoch count to the prepared loader (a seedable sampler's next ``set_epoch``).
Not covered (left as stock): ``DataLoaderDispatcher`` (``dispatch_batches=True``) and stateful
data loaders (``use_stateful_dataloader=True``, which restore a position of their own). The module-level
``accelerate.skip_first_batches`` makes a copy this module never sees: use the accelerator's
method (``acc.skip_first_batches``), as accelerate's own examples do.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from accelerate.data_loader import DataLoaderShard, get_sampler

#: The per-process file in a checkpoint (written into the transaction's directory).
EPOCH_START_FILE = "txckpt_epoch_start_{process}.pt"


class EpochStart:
    """What one prepared loader (and its skip copies) share: the running epoch's start, and the
    start a ``load_state`` asked the next iteration to replay."""

    def __init__(self, owner: Any, generators: list[torch.Generator]) -> None:
        self.owner = owner  # the prepared loader
        self.generators = generators  # the prepared loader's (its skip copies share them)
        self.start: dict[str, Any] | None = None  # the running iteration's epoch-start states
        self.live: Any = None  # the loader iterating now (None: between epochs)
        self.pending: dict[str, Any] | None = None  # set by load_state, used by the next iteration


def _generators(loader: Any) -> list[torch.Generator]:
    """The generators the loader's sampling draws from, each once, in a fixed order."""
    found: list[torch.Generator] = []
    for g in (
        getattr(loader, "synchronized_generator", None),
        getattr(loader.base_dataloader, "generator", None),
        getattr(get_sampler(loader), "generator", None),
    ):
        if isinstance(g, torch.Generator) and all(g is not h for h in found):
            found.append(g)
    return found


class _TrackedShard:
    """Mixed into a prepared DataLoaderShard's class (see :func:`track`)."""

    _txckpt_epoch: EpochStart

    def __iter__(self):
        record = self._txckpt_epoch
        pending, record.pending = record.pending, None
        if pending is not None:  # replay the epoch's start the checkpoint recorded
            torch.set_rng_state(pending["torch"])
            for g, state in zip(record.generators, pending["generators"]):
                g.set_state(state)
            self.iteration = pending["iteration"]
        record.start = {
            "torch": torch.get_rng_state(),
            "generators": [g.get_state() for g in record.generators],
            "iteration": self.iteration,
        }
        record.live = self
        for batch in super().__iter__():  # type: ignore[misc]  # the DataLoader class it is mixed into
            if pending is not None:  # the epoch's draws are done: continue from the saved step's state
                torch.set_rng_state(pending["after"])
                pending = None
            yield batch
        if record.live is self:
            record.live = None
        if record.owner is not self:
            # A skip copy ran the epoch's rest and counted it: the prepared loader's next epoch
            # is the one after it (a seedable sampler's set_epoch), as in the run that never stopped.
            record.owner.iteration = self.iteration


_CLASSES: dict[type, type] = {}


def track(loader: Any, record: EpochStart | None = None) -> Any:
    """Make ``loader`` (a DataLoaderShard) record its epoch starts into ``record`` (a new one if
    None); other loaders are returned as they are. accelerate's loader classes report their base
    loader's class through a ``__class__`` property, so the class is swapped with object's own
    ``__class__`` setter (a subclass adding no state: the layout is the same)."""
    cls = type(loader)
    if not isinstance(loader, DataLoaderShard) or issubclass(cls, _TrackedShard):
        return loader
    if getattr(loader, "use_stateful_dataloader", False):
        return loader  # it saves and restores its own position and sampler (not measured with this)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (_TrackedShard, cls), {"__module__": cls.__module__})
    object.__dict__["__class__"].__set__(loader, _CLASSES[cls])
    loader._txckpt_epoch = record if record is not None else EpochStart(loader, _generators(loader))
    return loader


def record_of(loader: Any) -> EpochStart | None:
    return getattr(loader, "_txckpt_epoch", None) if isinstance(loader, _TrackedShard) else None


def write_epoch_starts(dataloaders: list, process_index: int, directory: str) -> None:
    """Into a save's directory: for each prepared loader, its epoch start if it is mid-epoch.
    Nothing without a prepared loader (a checkpoint then holds exactly what stock writes)."""
    if not any(record_of(loader) is not None for loader in dataloaders):
        return
    entries = []
    for loader in dataloaders:
        record = record_of(loader)
        live = None if record is None else record.live
        start = None if record is None else record.start
        mid_epoch = live is not None and not live.end_of_dataloader and start is not None
        entries.append(dict(start, mid_epoch=True) if mid_epoch and start is not None else {"mid_epoch": False})
    torch.save(
        {"version": 1, "loaders": entries}, os.path.join(directory, EPOCH_START_FILE.format(process=process_index))
    )


def read_epoch_starts(dataloaders: list, process_index: int, directory: str) -> None:
    """After accelerate's load_state restored the step's RNGs: the next iteration of each loader
    that was mid-epoch replays its epoch's start. A checkpoint without the file (stock
    accelerate's, or another number of processes) changes nothing."""
    path = os.path.join(directory, EPOCH_START_FILE.format(process=process_index))
    if not os.path.exists(path):
        return
    entries = torch.load(path, weights_only=True)["loaders"]  # tensors, numbers and flags only
    after = torch.get_rng_state()
    for loader, entry in zip(dataloaders, entries):
        record = record_of(loader)
        if record is None:
            continue
        record.live = None
        record.pending = dict(entry, after=after) if entry["mid_epoch"] else None

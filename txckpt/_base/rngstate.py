"""Random generator state: ``rng_state()`` captures every generator a training loop draws from
(Python's ``random``, numpy's global generator where numpy imports, torch's CPU generator, and
the CUDA generators of every device once CUDA is initialised), ``set_rng_state(state)`` puts
them back exactly.

The state is one rank's: each rank captures and restores its own (a file per rank, as the
Trainer's ``rng_state_{rank}.pth``). It is a plain dict of ints, lists, strings and CPU
``uint8`` tensors, with a ``version``: ``torch.save`` writes it and ``load_checkpoint``'s
``weights_only=True`` loader reads it back, and pickle does too. Its layout (which generators,
how many CUDA devices) must be this process's: a state from another layout raises
:class:`~txckpt.errors.RngStateError` before anything is restored, unless ``strict=False``.
"""

from __future__ import annotations

import logging
import random
from typing import Any

from . import deps
from ..errors import RngStateError

log = logging.getLogger("txckpt")

#: The format of the dict rng_state returns (its ``version``).
RNG_STATE_VERSION = 1


def _numpy() -> Any:
    try:
        return deps.numpy
    except ImportError:
        return None


def _cuda_initialised() -> bool:
    cuda = deps.torch.cuda
    return bool(cuda.is_available() and cuda.is_initialized())


def rng_state() -> dict[str, Any]:
    """This rank's generators as a plain dict: ``version``, ``python`` (``random.getstate()``
    as lists), ``numpy`` (the global ``np.random`` state, or None where numpy does not import),
    ``torch`` (the CPU generator's state tensor) and ``cuda`` (one state tensor per device, or
    None while CUDA is not initialised: nothing drew from it yet). ``torch.save`` and
    ``txckpt.save_checkpoint`` write it; :func:`set_rng_state` restores it."""
    torch = deps.torch
    version, internal, gauss = random.getstate()
    np = _numpy()
    numpy_state = None
    if np is not None:
        st = np.random.get_state(legacy=False)
        numpy_state = {
            "bit_generator": str(st["bit_generator"]),
            "key": [int(x) for x in st["state"]["key"]],
            "pos": int(st["state"]["pos"]),
            "has_gauss": int(st["has_gauss"]),
            "gauss": float(st["gauss"]),
        }
    cuda = [t.clone() for t in torch.cuda.get_rng_state_all()] if _cuda_initialised() else None
    return {
        "version": RNG_STATE_VERSION,
        "python": [int(version), [int(x) for x in internal], gauss],
        "numpy": numpy_state,
        "torch": torch.get_rng_state().clone(),
        "cuda": cuda,
    }


def _layout_of_state(state: Any) -> dict[str, Any]:
    if not isinstance(state, dict):
        return {"type": type(state).__name__}
    cuda = state.get("cuda")
    missing = [k for k in ("version", "python", "torch") if k not in state]
    if missing:
        return {"missing": missing}
    return {
        "version": state.get("version"),
        "numpy": state.get("numpy") is not None,
        "cuda": len(cuda) if isinstance(cuda, (list, tuple)) else None,
    }


def _layout_here() -> dict[str, Any]:
    cuda = deps.torch.cuda
    return {
        "version": RNG_STATE_VERSION,
        "numpy": _numpy() is not None,
        "cuda": cuda.device_count() if cuda.is_available() else None,
    }


def _mismatch(found: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """What keeps a state of layout ``found`` from being restored exactly here."""
    if "type" in found:
        return [f"it is a {found['type']}, not the dict txckpt.rng_state() returns"]
    if "missing" in found:
        return [f"it has no {', '.join(found['missing'])}: not a dict txckpt.rng_state() returned"]
    if found["version"] != RNG_STATE_VERSION:
        return [f"its version is {found['version']!r}; this txckpt reads version {RNG_STATE_VERSION}"]
    why = []
    if found["numpy"] and not here["numpy"]:
        why.append("it holds numpy's generator, and numpy does not import here")
    if found["cuda"] is not None and found["cuda"] != here["cuda"]:
        why.append(
            f"it holds {found['cuda']} CUDA generator(s), and this process has "
            f"{'no CUDA' if here['cuda'] is None else str(here['cuda']) + ' CUDA device(s)'}"
        )
    return why


def set_rng_state(state: dict[str, Any], *, strict: bool = True) -> None:
    """Restore the generators :func:`rng_state` captured, exactly: the next draws of each are
    the ones that followed the capture. Raises RngStateError (nothing restored) for a state of
    another version or layout (numpy captured but missing here, another number of CUDA
    devices); ``strict=False`` restores the generators both have, logs the others at WARNING
    and still refuses another version. A generator the state lacks (numpy installed since; CUDA
    not yet initialised at the capture) is left as it is."""
    found, here = _layout_of_state(state), _layout_here()
    why = _mismatch(found, here)
    fatal = "type" in found or "missing" in found or found["version"] != RNG_STATE_VERSION
    if why and (strict or fatal):
        raise RngStateError(
            f"txckpt.set_rng_state: the state cannot be restored exactly here: {'; '.join(why)}. "
            "Nothing was restored. Restore each rank's own state in a process with the same devices "
            "(and numpy, if it was captured with it), or pass strict=False to restore the generators "
            "both have.",
            state_layout=found,
            process_layout=here,
        )
    if why:
        log.warning("txckpt.set_rng_state(strict=False): not restored: %s", "; ".join(why))
    torch = deps.torch
    version, internal, gauss = state["python"]
    py = (int(version), tuple(int(x) for x in internal), gauss)
    np = _numpy()
    npst = state.get("numpy")
    cpu = state["torch"]
    cuda = state.get("cuda")
    random.setstate(py)
    if npst is not None and np is not None:
        np.random.set_state(
            {
                "bit_generator": npst["bit_generator"],
                "state": {"key": np.asarray(npst["key"], dtype=np.uint32), "pos": int(npst["pos"])},
                "has_gauss": int(npst["has_gauss"]),
                "gauss": float(npst["gauss"]),
            }
        )
    torch.set_rng_state(cpu.to("cpu") if isinstance(cpu, torch.Tensor) else torch.as_tensor(cpu, dtype=torch.uint8))
    if cuda is not None and here["cuda"] is not None and len(cuda) == here["cuda"]:
        torch.cuda.set_rng_state_all([t.to("cpu") for t in cuda])


__all__ = ["rng_state", "set_rng_state", "RNG_STATE_VERSION"]

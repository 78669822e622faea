"""Calibrating a CUDA device the cost table (gemmconv.core.device_rates) does not know.

``prepare`` calibrates the device once, before the first decision made outside a CUDA
graph capture (gemmconv.selection.dispatch calls it), so no estimate opens the database
or benchmarks: ``calibrate`` reads the rates stored in the find database, else measures
them (gemmconv.measuring.measure.peak_rates) and stores them there. It lives above the
solvers, the measuring engine and the database, which the cost table, read by the
solvers, must not import.
"""

from __future__ import annotations

import logging

import torch

from gemmconv.core import device_rates
from gemmconv.core.device_rates import DeviceRates

# Calibration logs on the cost table's logger, the name a user filters on.
log = logging.getLogger("gemmconv.device_rates")


def prepare(device_type: str, index: int = 0) -> None:
    """Calibrate CUDA device ``index`` once if the table does not know it. Not while a
    CUDA graph is being captured (measuring synchronises the device): the estimate
    then uses the nearest entry, and a later decision calibrates."""
    if device_type != "cuda" or not torch.cuda.is_available() or index in device_rates._calibrated:
        return
    if device_rates._device_name(index) in device_rates._TABLE:
        return
    if _several_ranks():
        # Each rank would measure other rates, and estimates would differ across ranks;
        # the nearest entry, the same on every rank, prices the device until
        # gemmconv.sync_choices() shares the first rank's measurement.
        return
    if torch.cuda.is_current_stream_capturing():
        log.info("%s: not calibrated inside a CUDA graph capture; costed as %s for now",
                 device_rates._device_name(index), device_rates.NEAREST_GPU.name)  # fmt: skip
        return
    device_rates._calibrated[index] = calibrate(index)


def _several_ranks() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def calibrate_unknown_device(index: int = 0) -> None:
    """Calibrate CUDA device ``index`` now if the table does not know it, in a
    distributed run too (gemmconv.sync_choices calls it on one rank, then shares what
    it measured)."""
    known = device_rates._calibrated
    if not torch.cuda.is_available() or index in known:
        return
    if device_rates._device_name(index) in device_rates._TABLE:
        return
    if torch.cuda.is_current_stream_capturing():
        return
    known[index] = calibrate(index)


def calibrate(index: int = 0) -> DeviceRates:
    """The rates of CUDA device ``index`` stored in the find database, else measured now
    and stored there. A database that fails (locked past its timeout, unreadable, a
    full disk) is a miss, or a result not stored, with a warning: never an error."""
    from gemmconv.selection import finddb

    identity = finddb.identity_for("cuda", index)
    try:
        stored = finddb.get_db().lookup_rates(identity)
    except finddb.DATABASE_ERRORS as e:
        log.warning("stored rates for %s unreadable (%s: %s); measuring them",
                    identity.device, type(e).__name__, e)  # fmt: skip
        stored = None
    if stored is not None:
        try:
            # Rates stored without factors take the nearest entry's, as measured ones do;
            # rates stored before a factor was added take that one from the entry too.
            factors = {**device_rates.NEAREST_GPU.factors, **stored.get("factors", {})}
            return DeviceRates(**{**stored, "factors": factors})
        except TypeError:
            log.warning("stored rates for %s are unreadable; measuring again", identity.device)
    rates = measure_rates(index)
    try:
        finddb.get_db().store_rates(identity, rates.as_json())
    except finddb.DATABASE_ERRORS as e:
        log.warning("measured rates for %s not stored (%s: %s)",
                    identity.device, type(e).__name__, e)  # fmt: skip
    return rates


def measure_rates(index: int = 0) -> DeviceRates:
    """Measure the peak rates of CUDA device ``index``
    (gemmconv.measuring.measure.peak_rates); its fitted factors, which need a suite run,
    are the nearest entry's."""
    from gemmconv.measuring.measure import MATH_MODES, TimingPolicy, peak_rates

    nearest = device_rates.NEAREST_GPU
    device = torch.device("cuda", index)
    tflops, bandwidth = peak_rates(device, list(MATH_MODES), TimingPolicy(warmup=5, reps=10))
    tflops["fp64"] = tflops["fp32"]
    rates = DeviceRates(
        name=torch.cuda.get_device_name(index),
        matrix_tflops={k: round(v, 1) for k, v in tflops.items()},
        bandwidth_gbs=round(bandwidth, 1),
        launch_us=5.0,
        # The alignment cliff measured on Hopper is assumed here too.
        unaligned_slowdown=nearest.unaligned_slowdown,
        multiprocessors=torch.cuda.get_device_properties(index).multi_processor_count,
        factors=nearest.factors,
        source=f"peak rates measured at first use; factors: the {nearest.name} entry's",
    )
    log.info("measured peak rates of %s: %s", rates.name, rates)
    return rates


__all__ = ["calibrate", "calibrate_unknown_device", "measure_rates", "prepare"]

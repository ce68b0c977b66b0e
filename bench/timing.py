"""The timing protocol: implementations of one row timed interleaved, round by round, so that
noise from a shared machine hits all of them alike."""
import math
from dataclasses import dataclass
from time import perf_counter

import numpy as np


@dataclass
class Protocol:
    """How long to measure.  Each implementation gets about `target` seconds per row,
    as `rounds` samples of `number` back-to-back calls, interleaved round by round."""
    target: float = 0.3          # seconds per implementation per row
    min_rounds: int = 5          # for ours and the probe
    min_rounds_peer: int = 3     # for peers whose call is shorter than `target`
    max_rounds: int = 60
    min_sample: float = 2e-3     # a sample lasts at least this long (tiny calls are batched)
    warmup: float = 0.02         # seconds of warm-up calls (at least one call)
    fixed_rounds: int = 0        # > 0: exactly this many rounds of one call (smoke tests)
    slow_peer_once: bool = False  # a peer whose warm-up call exceeds `target` is timed by
    #                               that call alone (quick mode: the f64 reference is slow)


FULL = Protocol(slow_peer_once=True)
QUICK = Protocol(target=0.02, min_rounds=3, min_rounds_peer=1, max_rounds=15,
                 min_sample=1e-3, warmup=0.003, slow_peer_once=True)


def summarise(samples):
    arr = np.asarray(samples)
    q1, med, q3 = np.percentile(arr, [25, 50, 75])
    return {"median": float(med), "min": float(arr.min()), "q1": float(q1), "q3": float(q3),
            "samples": len(samples)}


def is_subject(name, subjects):
    """Whether `name` is timed like ours (more rounds): listed, or a variant "ours:<body>"."""
    return name in subjects or name.split(":", 1)[0] in subjects


def measure(fns, protocol, subjects=("ours", "probe"), known=None, before=None, count=None):
    """Time the callables of `fns` ({name: fn}) interleaved; {name: summary of s/call}.

    Warm-up first (at least one call each), then rounds: in round k every implementation
    that still needs samples runs `number` calls, starting from a rotating position so no
    implementation always follows the same one.  The median per call is the figure used.
    `before` ({name: fn}, optional) runs untimed before each warm-up and each batch of that
    implementation (e.g. to select a kernel body).  `known` ({name: seconds}) is a call of a
    slow peer already timed on this data.  `count` (optional) returns {event: running total}
    (page faults, say); it is read untimed around every batch whose times are the samples, and
    each summary gets "per_call": {event: mean per call over those calls} (None for a `known`
    peer, whose call was not made here)."""
    before = before or {}
    nothing = lambda: None  # noqa: E731
    plan = {}
    warm_times = {}
    warm_counts = {}
    for name, fn in fns.items():
        warm = warm_times[name] = []
        if (known and name in known and protocol.slow_peer_once
                and known[name] >= protocol.target):
            warm.append(known[name])     # a slow peer already timed on this data: reuse
            plan[name] = (1, 0, 0)
            warm_counts[name] = None
            continue
        prepare = before.get(name, nothing)
        events = warm_counts[name] = {}
        while not warm or (sum(warm) < protocol.warmup and not protocol.fixed_rounds):
            prepare()
            c0 = count() if count else None
            t0 = perf_counter()
            fn()
            warm.append(perf_counter() - t0)
            if count:
                _add_events(events, c0, count())
        if protocol.fixed_rounds:
            plan[name] = (1, protocol.fixed_rounds, protocol.fixed_rounds)
            continue
        per_call = max(float(np.median(warm)), 1e-9)
        subject = is_subject(name, subjects)
        if protocol.slow_peer_once and not subject and per_call >= protocol.target:
            plan[name] = (1, 0, 0)        # the warm-up call is the sample
            continue
        number = max(1, math.ceil(protocol.min_sample / per_call))
        floor = protocol.min_rounds if subject else (
            protocol.min_rounds_peer if per_call < protocol.target else 1)
        rounds = int(min(protocol.max_rounds,
                         max(floor, round(protocol.target / (number * per_call)))))
        plan[name] = (number, rounds, floor)
    samples = {name: [] if plan[name][1] else warm_times[name] for name in fns}
    # events of the calls whose times are the samples: the warm-up's when it is the sample
    counted = {name: {} if plan[name][1] else warm_counts[name] for name in fns}
    spent = dict.fromkeys(fns, 0.0)
    budget = 3 * protocol.target      # a noisy machine can make calls far slower than planned
    names = list(fns)
    k = 0

    def wanted(name):
        _, rounds, floor = plan[name]
        done = len(samples[name])
        return done < rounds and (done < floor or spent[name] < budget)

    while any(wanted(name) for name in names):
        for i in range(len(names)):
            name = names[(i + k) % len(names)]
            if not wanted(name):
                continue
            number = plan[name][0]
            fn = fns[name]
            before.get(name, nothing)()
            c0 = count() if count else None
            t0 = perf_counter()
            for _ in range(number):
                fn()
            dt = perf_counter() - t0
            if count:
                _add_events(counted[name], c0, count(), number)
            spent[name] += dt
            samples[name].append(dt / number)
        k += 1
    result = {name: summarise(samples[name]) for name in names}
    if count:
        for name in names:
            events = counted[name]
            calls = events.pop("calls", 0) if events is not None else 0
            result[name]["per_call"] = ({event: total / calls for event, total in events.items()}
                                        if calls else None)
    return result


def _add_events(totals, start, end, calls=1):
    """Add the events between two `count()` readings, and the calls they cover, to `totals`."""
    for event, value in end.items():
        totals[event] = totals.get(event, 0) + value - start[event]
    totals["calls"] = totals.get("calls", 0) + calls

"""Ray: ``hvdkit.ray.run(fn, num_workers=N)`` trains on a Ray cluster, one actor per rank.

Everything hvdkit knows about Ray is here. A placement group reserves one
bundle of ``cpus_per_worker`` CPUs (and GPUs) per rank, spread over the
nodes (``SPREAD``: as many nodes as it can); one actor per bundle is one rank.
The actors report their node's address, rank 0's actor serves Gloo's
rendezvous (:mod:`hvdkit.clusters._world`) and each actor runs ``fn`` with
Horovod's Gloo variables set, so ``hvdkit.init()`` inside ``fn`` gives
``size() == num_workers`` and local ranks per node.

Faults: a lost actor or node ends the attempt, and so does a rank that sent
no heartbeat for ``HVDKIT_STALL_TIMEOUT`` (a frozen process; 120 s). The driver stops every actor
of the attempt at once (it does not wait for Gloo to time out), frees the
placement group and, up to ``max_restarts`` times, starts the ranks again
on whatever nodes are left; ``fn`` resumes from its ``hvdkit.Checkpointer``
on a folder every node sees. Why a restart and not hvdkit's in-process
elastic recovery: that needs hvdkit's scheduler and a worker process per
host to carry the regroup, where Ray already owns placement and process
lifetime; a restart reuses what Ray does well and costs one TensorFlow start
and one restore (docs/ray.md gives the measured time). An error ``fn``
itself raised is not retried: it is raised on the driver with the rank's
traceback.

Example (a driver script on a node of the cluster: ``python driver.py``)::

    import ray
    import hvdkit.ray

    def train():
        import hvdkit
        hvdkit.init()
        ...
        return hvdkit.rank()

    ray.init()                               # the running cluster
    print(hvdkit.ray.run(train, num_workers=2))   # [0, 1]
"""

from __future__ import annotations

import logging
import os
import re
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .. import config
from .._validate import is_int, is_number
from ..errors import ConfigurationError, LaunchError, NotSupportedError
from . import _call, _world

__all__ = ["RayExecutor", "run"]
log = logging.getLogger("hvdkit.ray")

STRATEGIES = ("SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK")
_NODE_FIX = (
    "The nodes must reach each other at the addresses Ray knows them by "
    "(ray start --node-ip-address)."
)


def run(
    fn: Callable,
    args: Sequence = (),
    kwargs: Mapping | None = None,
    num_workers: int = 1,
    cpus_per_worker: float = 1,
    use_gpu: bool = False,
    gpus_per_worker: float | None = None,
    env: Mapping[str, str] | None = None,
    start_timeout: float | None = None,
    max_restarts: int = 3,
    placement_strategy: str | None = None,
    verbose: int = 1,
) -> list:
    """Run ``fn(*args, **kwargs)`` as ``num_workers`` ranks on the Ray cluster; results by rank.

    Args:
        fn: the training function (Ray pickles it; a closure is fine). Its
            return value must be picklable.
        args, kwargs: passed to ``fn``.
        num_workers: ranks, one actor each.
        cpus_per_worker, use_gpu, gpus_per_worker: each actor's resources
            (``gpus_per_worker`` defaults to 1 with ``use_gpu``; GPU paths are
            not verified here: no GPU).
        env: variables set in every rank before ``fn`` runs.
        start_timeout: seconds to wait for the placement group and for the
            ranks to meet; ``None``: 600.
        max_restarts: attempts after a lost actor or node (default 3).
        placement_strategy: Ray's ``SPREAD`` (the default), ``STRICT_SPREAD``,
            ``PACK`` or ``STRICT_PACK``.
        verbose: 0 prints nothing of hvdkit's own; 1 (default) its restarts.

    Returns:
        ``fn``'s return values, ``[rank 0's, rank 1's, ...]``.

    Raises:
        ConfigurationError: bad arguments; more CPUs/GPUs asked for than the
            cluster has (within seconds, not a placement that waits for ever);
            the placement group not ready within ``start_timeout``.
        LaunchError: ``fn`` raised on a rank (its traceback), or every attempt
            lost a rank.

    Example:
        >>> hvdkit.ray.run(lambda: __import__("hvdkit").size(), num_workers=2)  # doctest: +SKIP
        [2, 2]
    """
    _check_count("max_restarts", max_restarts, minimum=0)
    executor = RayExecutor(
        num_workers=num_workers,
        cpus_per_worker=cpus_per_worker,
        use_gpu=use_gpu,
        gpus_per_worker=gpus_per_worker,
        env=env,
        start_timeout=start_timeout,
        placement_strategy=placement_strategy,
    )
    for attempt in range(max_restarts + 1):
        try:
            executor.start()  # an actor lost while the ranks meet is a lost rank too
            return executor.run(fn, args, kwargs)
        except _RankLost as lost:
            if attempt == max_restarts:
                raise LaunchError(
                    f"hvdkit.ray.run: {num_workers} ranks lost a rank {attempt + 1} times; the "
                    f"last time: {lost}. Raise max_restarts, or see the Ray logs for why."
                ) from None
            if verbose >= 1:
                print(
                    f"hvdkit.ray: attempt {attempt + 1} lost a rank ({lost}); starting the "
                    f"ranks again ({max_restarts - attempt} more allowed)",
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            executor.shutdown()
    raise AssertionError("unreachable")  # the loop returns or raises


class _RankLost(LaunchError):
    """An actor, its node or a peer of a rank was lost: worth starting again.

    :func:`run` starts the ranks again; a :class:`RayExecutor` user gets it as
    the ``LaunchError`` it is.
    """


class RayExecutor:
    """Horovod's ``horovod.ray.RayExecutor``: ``start()``, ``run(fn)`` (repeatable), ``shutdown()``.

    The actors (one per rank) and their Gloo world live from ``start`` to
    ``shutdown``, so ``hvdkit.init()`` in a second ``run`` finds the world
    already started. No restart here: :func:`run` restarts. Horovod's
    arguments, positions included: ``num_workers``, or ``num_hosts`` x
    ``num_workers_per_host`` (one bundle per host, ``STRICT_SPREAD``);
    ``use_current_placement_group=True`` refuses to start inside another
    placement group (hvdkit makes its own). ``settings`` is accepted and not
    read (hvdkit's settings are its variables).

    Example::

        executor = hvdkit.ray.RayExecutor(num_workers=2)
        executor.start()
        ranks = executor.run(lambda: __import__("hvdkit").rank())   # [0, 1]
        executor.shutdown()
    """

    def __init__(
        self,
        settings: Any = None,
        num_workers: int | None = None,
        num_hosts: int | None = None,
        num_workers_per_host: int = 1,
        cpus_per_worker: float = 1,
        use_gpu: bool = False,
        gpus_per_worker: float | None = None,
        use_current_placement_group: bool = True,
        *,
        env: Mapping[str, str] | None = None,
        start_timeout: float | None = None,
        placement_strategy: str | None = None,
    ):
        if num_hosts is not None:  # Horovod's other way: so many ranks on each of so many nodes
            if num_workers is not None:
                raise ConfigurationError(
                    f"RayExecutor(num_workers={num_workers!r}, num_hosts={num_hosts!r}): give "
                    "one of them (num_hosts goes with num_workers_per_host)."
                )
            _check_count("num_hosts", num_hosts, minimum=1)
            _check_count("num_workers_per_host", num_workers_per_host, minimum=1)
            num_workers, self.per_bundle = num_hosts * num_workers_per_host, num_workers_per_host
        else:
            num_workers, self.per_bundle = 1 if num_workers is None else num_workers, 1
        _check_count("num_workers", num_workers, minimum=1)
        _check_amount("cpus_per_worker", cpus_per_worker)
        if gpus_per_worker is not None:
            _check_amount("gpus_per_worker", gpus_per_worker)
        if placement_strategy is None:  # one bundle per host must land on distinct hosts
            placement_strategy = "STRICT_SPREAD" if num_hosts is not None else "SPREAD"
        if placement_strategy not in STRATEGIES:
            raise ConfigurationError(
                f"placement_strategy={placement_strategy!r}: use one of {', '.join(STRATEGIES)}."
            )
        self.num_workers = num_workers
        self.cpus = float(cpus_per_worker)
        self.gpus = float(gpus_per_worker if gpus_per_worker is not None else use_gpu)
        self.use_current_placement_group = use_current_placement_group
        self.env = dict(env or {})
        self.timeout_s = _start_timeout(start_timeout)
        self.strategy = placement_strategy
        self._pg = None
        self._cpus_free = 0.0  # the cluster's free CPUs before the placement group
        self._actors: list = []
        self._watch: _world.StallWatch | None = None

    def start(self) -> None:
        """Reserve the bundles, start one actor per rank and have them meet."""
        ray = _ray()
        self._check_resources(ray)
        from ray.util.placement_group import placement_group

        if self.use_current_placement_group and ray.util.get_current_placement_group():
            raise NotSupportedError(
                "RayExecutor runs inside a placement group (a Ray Tune trial, another actor's "
                "group) and use_current_placement_group=True, but hvdkit places its ranks in a "
                "group of its own. Pass use_current_placement_group=False, or start it from the "
                "driver."
            )
        each = self.per_bundle  # ranks per bundle: num_workers_per_host, else 1
        bundle = {"CPU": self.cpus * each} | ({"GPU": self.gpus * each} if self.gpus else {})
        bundles = [dict(bundle) for _ in range(self.num_workers // each)]
        self._cpus_free = ray.available_resources().get("CPU", 0.0)  # before our bundles
        self._pg = placement_group(bundles, strategy=self.strategy)
        try:
            self._start_ranks(ray, bundle)
        except BaseException:  # whatever failed, no actor or bundle of it is left behind
            self.shutdown()
            raise

    def _start_ranks(self, ray, bundle: dict) -> None:
        """Once the placement group is ready: one actor per rank, and the ranks meet."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        each = self.per_bundle
        try:
            ray.get(self._pg.ready(), timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise ConfigurationError(
                f"Ray could not place {self.num_workers} ranks of {bundle} with "
                f"{self.strategy} within {self.timeout_s:g} s (start_timeout); the cluster has "
                f"{_free(ray)}. Lower num_workers or cpus_per_worker, use "
                "placement_strategy='SPREAD', or add nodes."
            ) from None
        actor_cls = ray.remote(_Rank)
        self._actors = [
            actor_cls.options(
                num_cpus=self.cpus,
                num_gpus=self.gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=i // each
                ),
            ).remote()
            for i in range(self.num_workers)
        ]
        hosts = self._get([a.host.remote() for a in self._actors])
        addresses = [_world.resolve(h, f"node {h}", _NODE_FIX) for h in hosts]
        _world.check_reachable(hosts, addresses, _NODE_FIX)
        world = _world.places(hosts)
        self._watch = _world.StallWatch(ray.util.get_node_ip_address())
        port = self._get([self._actors[0].serve.remote(hosts[0], sorted(set(hosts)), world)])[0]
        self._get(
            [
                a.join.remote(
                    world[i], hosts[0], port, self.env | self._watch.env(), len(set(hosts))
                )
                for i, a in enumerate(self._actors)
            ]
        )

    def run(self, fn: Callable, args: Sequence = (), kwargs: Mapping | None = None) -> list:
        """``fn(*args, **kwargs)`` on every rank; the return values by rank."""
        if not self._actors:
            raise ConfigurationError("RayExecutor.run before start(); call start() first.")
        ray = _ray()
        try:
            refs = [a.call.remote(fn, tuple(args), dict(kwargs or {})) for a in self._actors]
        except TypeError as exc:  # Ray's serializer: "Could not serialize the argument ..."
            name = getattr(fn, "__qualname__", repr(fn))
            raise ConfigurationError(
                f"hvdkit.ray cannot send {name} and its arguments to the ranks ({exc}). Build "
                "such objects (sessions, locks, open files, models) inside fn, and pass only "
                "plain data (or ray.put references) as args."
            ) from None
        rank_of = {ref: i for i, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            if not done:
                silent = self._watch.silent() if self._watch is not None else None
                if silent:
                    raise _RankLost(silent)
                continue
            rank = rank_of[done[0]]
            try:
                out = ray.get(done[0])
            except ray.exceptions.RayError as exc:  # the actor or its node is gone
                missing = _MISSING_MODULE.search(str(exc))
                if isinstance(exc, ray.exceptions.RayTaskError) and missing:
                    raise LaunchError(_cannot_import(rank, missing.group(0))) from None
                raise _RankLost(f"rank {rank}: {type(exc).__name__}") from None
            if out[0] == _call.OK:
                results[rank] = out[1]
            elif out[1] == _call.LOST_PEER:
                raise _RankLost(f"rank {rank} lost a peer: {_call.summary(out[2])}")
            else:
                raise LaunchError(f"hvdkit.ray.run: fn raised on rank {rank}:\n{out[2]}")
        return [results[r] for r in range(len(refs))]

    def shutdown(self) -> None:
        """Stop every actor at once and free the placement group."""
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        if not self._actors and self._pg is None:
            return
        ray = _ray()
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone with its node
                pass
        self._actors = []
        if self._pg is not None:
            _remove_and_wait(ray, self._pg, self._cpus_free)
            self._pg = None

    def _check_resources(self, ray) -> None:
        total = ray.cluster_resources()
        for name, each in (("CPU", self.cpus), ("GPU", self.gpus)):
            want = each * self.num_workers
            if want and total.get(name, 0.0) < want:
                per = "cpus_per_worker" if name == "CPU" else "gpus_per_worker"
                raise ConfigurationError(
                    f"hvdkit.ray: num_workers={self.num_workers} x {per}={each:g} needs "
                    f"{want:g} {name}s, but the Ray cluster has {total.get(name, 0.0):g} "
                    f"(ray.cluster_resources()). Lower num_workers or {per}, or add nodes; "
                    "otherwise the actors would wait for ever."
                )

    def _get(self, refs: list) -> list:
        """``ray.get`` while the ranks start (:meth:`start` shuts down on any error)."""
        ray = _ray()
        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise ConfigurationError(
                f"hvdkit.ray: the ranks did not start and meet within {self.timeout_s:g} s "
                "(start_timeout); see the Ray logs of the actors."
            ) from None
        except ray.exceptions.RayTaskError as exc:  # a rank's set-up raised: no retry helps
            raise ConfigurationError(f"hvdkit.ray: a rank could not start: {exc}") from None
        except ray.exceptions.RayError as exc:  # an actor died while starting
            raise _RankLost(f"while starting: {type(exc).__name__}") from None


# A rank could not unpickle fn's arguments (RayTaskError(RaySystemError)): a module
# the Ray workers cannot import; every retry would fail the same way.
_MISSING_MODULE = re.compile(r"No module named '[^']+'")


def _cannot_import(rank: int, missing: str) -> str:
    ship = "ray.init(runtime_env={'py_modules': [module]}) or {'working_dir': '.'}"
    return f"hvdkit.ray.run: rank {rank} {_call.CANNOT_LOAD} and its arguments: {missing}." + (
        _call.unimportable_fix("Ray workers", ship, "ray")
    )


class _Rank:
    """One rank (a Ray actor): its node's address, rank 0's rendezvous, and ``fn``."""

    def __init__(self):
        self._server = None

    def host(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def serve(self, address: str, allowed: list[str], world: list) -> int:
        self._server, port = _world.serve(address, 0, set(allowed), world)
        return port

    def join(self, place, address: str, port: int, env: dict, hosts: int):
        mine = _world.local_address_towards(
            address, port, _world.REACH_TIMEOUT_S, f"It runs in rank 0's actor. {_NODE_FIX}"
        )
        os.environ.update(_world.horovod_env(place, address, port, mine, hosts=hosts))
        os.environ.update(env)

    def call(self, fn, args, kwargs):
        try:
            return (_call.OK, fn(*args, **kwargs))
        except Exception as exc:
            return (_call.RAISED, _call.kind_of(exc), "".join(traceback.format_exception(exc)))


# ------------------------------------------------------------------ checks
REMOVE_WAIT_S = 30.0


def _remove_and_wait(ray, pg, cpus_free: float = 0.0) -> None:
    """Remove the placement group and wait until Ray has (its bundles are free again).

    Ray removes it asynchronously: a ``run`` that started at once could find
    the last run's CPUs still held and be placed otherwise (``SPREAD`` packing
    what it would have spread), so each run starts on a cluster as it was. The
    group's state says ``REMOVED`` before its actors' CPUs are back, so the wait
    also lasts until the cluster has the CPUs free that it had before the group
    (``cpus_free``; at most what the cluster still has, if a node went away),
    at most :data:`REMOVE_WAIT_S` in all.
    """
    import time

    from ray.util import placement_group_table
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(pg)
        deadline = time.monotonic() + REMOVE_WAIT_S
        while placement_group_table(pg).get("state") != "REMOVED" or ray.available_resources().get(
            "CPU", 0.0
        ) < min(cpus_free, ray.cluster_resources().get("CPU", 0.0)):
            if time.monotonic() > deadline:
                log.warning("hvdkit.ray: placement group %s not removed yet", pg.id.hex())
                return
            time.sleep(0.1)
    except Exception as exc:  # the cluster is going away
        log.debug("hvdkit.ray: removing the placement group: %s", exc)


def _ray():
    try:
        import ray
    except ImportError:
        raise ConfigurationError(
            "hvdkit.ray needs Ray: pip install 'ray' (the version of your cluster)."
        ) from None
    if not ray.is_initialized():
        ray.init()  # the cluster this node belongs to (RAY_ADDRESS), else a local one
    return ray


def _free(ray) -> str:
    total = ray.cluster_resources()
    return ", ".join(f"{total.get(k, 0.0):g} {k}" for k in ("CPU", "GPU"))


def _check_count(name: str, value, *, minimum: int) -> None:
    if not is_int(value) or value < minimum:
        raise ConfigurationError(
            f"hvdkit.ray: {name}={value!r}; expected a whole number >= {minimum}."
        )


def _check_amount(name: str, value) -> None:
    if not is_number(value) or not value > 0:
        raise ConfigurationError(f"hvdkit.ray: {name}={value!r}; expected a number > 0.")


def _start_timeout(given: float | None) -> float:
    if given is None:
        return config.DEFAULT_START_TIMEOUT_S
    _check_amount("start_timeout", given)
    return float(given)

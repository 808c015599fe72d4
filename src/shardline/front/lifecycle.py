"""A front's lifecycle, the same for every owner of fronts (the cluster client and the API's view follower
through it, a local Engine): one front per instance on a session, opened once, kept up with the instance's
generations from what its owner learns besides the controller's own announcements (a cluster view), and
closed once, its requests ended with the reason.
"""

from __future__ import annotations

import threading
import time

import zenoh

from shardline.dataplane import messages as m
from shardline.dataplane.transport import Keys
from shardline.errors import EngineError
from shardline.front.front import Front, ModelLimits

REMOVED_AFTER_S = 2.0  # an instance missing from views this long is gone (a new master's first view may lag)


def catch_up(front: Front, update: m.Serving | m.InstanceFailed) -> None:
    """Tell a front what its owner learnt elsewhere (a view), when it is news to the front: a front that came
    late, or missed a message, learns what the controller announced."""
    news = front.generation != update.generation if isinstance(update, m.Serving) else front.failure is None
    if news:
        front.announce(update)


class Fronts:
    """The fronts one owner holds on its session, by instance."""

    def __init__(self, session: zenoh.Session, namespace: str = "shardline") -> None:
        self._session = session
        self._namespace = namespace
        self._lock = threading.Lock()
        self._fronts: dict[str, Front] = {}
        self._missing: dict[str, float] = {}  # instance -> since when its owner's views no longer list it
        self._closed: str | None = None  # why every front was closed, once they were

    def open(self, instance: str, limits: ModelLimits, *, start: bool = True, **kw: object) -> Front:
        """The front of `instance`: opened (and started, unless `start` is False) on the first ask, the same
        one after. It serves as soon as a generation of the instance does."""
        with self._lock:
            if self._closed is not None:
                raise EngineError(f"fronts are closed: {self._closed}")
            front = self._fronts.get(instance)
            if front is None:
                keys = Keys(instance, 0, self._namespace)
                front = Front(self._session, keys, limits, **kw)  # type: ignore[arg-type]
                if start:
                    front.start()
                self._fronts[instance] = front
            return front

    def get(self, instance: str) -> Front | None:
        with self._lock:
            return self._fronts.get(instance)

    def all(self) -> dict[str, Front]:
        with self._lock:
            return dict(self._fronts)

    def learn(self, instance: str, update: m.Serving | m.InstanceFailed) -> None:
        """What the owner learnt of `instance` besides its controller's announcements: see catch_up."""
        front = self.get(instance)
        if front is not None:
            catch_up(front, update)

    def close(self, instance: str, why: str) -> bool:
        """Close the front of an instance that is gone: its requests end with `why`, never wait forever."""
        with self._lock:
            front = self._fronts.pop(instance, None)
            self._missing.pop(instance, None)
        if front is None:
            return False
        front.close(why)
        return True

    def close_unlisted(self, listed: set[str], now: float | None = None) -> list[str]:
        """Close the fronts of instances the owner's views have not listed for REMOVED_AFTER_S; the instances
        closed."""
        now = time.monotonic() if now is None else now
        gone = []
        with self._lock:
            for instance in list(self._fronts):
                if instance in listed:
                    self._missing.pop(instance, None)
                elif now - self._missing.setdefault(instance, now) > REMOVED_AFTER_S:
                    gone.append(instance)
        return [i for i in gone if self.close(i, f"instance {i} was removed")]

    def close_all(self, why: str) -> None:
        """Close every front, and open none after: the owner is shutting down."""
        with self._lock:
            self._closed = why
            fronts = list(self._fronts.values())
        for front in fronts:
            front.close(why)

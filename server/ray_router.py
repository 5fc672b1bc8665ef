"""The worker replicas' request router on Ray Serve: Ray's consistent-hash router keyed by the
request's image, the least loaded replica for requests without one, one named replica on demand.

Ray's `ConsistentHashRouter` maps a request's `session_id` to a replica on a ring of the healthy
replicas, and tries the ring's next replica when that one is full; server.ray_serve's ingress sets
the session id to the image's key, so that a replica's image-prefix cache sees every question
about its images. This subclass changes two cases: a request without a key goes to the least
loaded replica (Ray's probe of the queue lengths) instead of a random one, and a key naming one
replica (`PIN` + its id) goes to that replica alone (the ingress's per-replica /metrics).
"""

from __future__ import annotations

import importlib

from ray.serve.experimental.consistent_hash_router import ConsistentHashRouter
from ray.serve.request_router import PendingRequest, RunningReplica

PIN = "replica="  # a session id naming the replica that must answer
# deployment name -> the replica ids this process's router routes to now (the ingress reads them
# to scrape each replica)
LIVE: dict[str, tuple[str, ...]] = {}


class ImageRouter(ConsistentHashRouter):
    """Consistent hashing over the healthy replicas by image; the least loaded without one."""

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        ids = tuple(sorted(replica.replica_id.unique_id for replica in replicas))
        # Ray ships this module to the router by value, so the class's own globals are a copy's:
        # the registry the ingress reads is the imported module's
        importlib.import_module(__name__).LIVE[self._deployment_id.name] = ids

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is None:
            return [list(candidate_replicas)]
        # back off between rounds in every case: Ray's loop retries at once otherwise
        pending_request.routing_context.should_backoff = True
        key = pending_request.metadata.session_id
        if key.startswith(PIN):
            wanted = key.removeprefix(PIN)
            named = [r for r in candidate_replicas if r.replica_id.unique_id == wanted]
            return [named] if named else []
        if not key:
            # one rank of them all: Ray picks the shortest queue among those that accept
            return [list(candidate_replicas)]
        return await super().choose_replicas(candidate_replicas, pending_request)


def replica_ids(deployment: str) -> tuple[str, ...]:
    """The ids of `deployment`'s replicas as this process's router last saw them."""
    return LIVE.get(deployment, ())

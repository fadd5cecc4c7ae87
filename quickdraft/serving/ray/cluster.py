"""``quickdraft serve MODEL --replicas N``: run the application on a local Ray instance or join a cluster.

Without an address a fresh local Ray instance is started for the replicas' CPUs (``ray.init(address="local")``: a
stale ``/tmp/ray/ray_current_cluster`` from a killed ``ray start`` must not be joined), without the dashboard, and
stopped on exit; with ``--ray-address`` the application is deployed to that cluster and deleted from it on exit.
SIGTERM and SIGINT stop it: the application is shut down first (its replicas drain), then Ray.
"""
from __future__ import annotations

import logging
import signal
import sys
import threading
from typing import Any

from quickdraft.serving.guard import ServerLimits
from quickdraft.serving.ray.app import ReplicaOptions, build_app

APP_NAME = "quickdraft"
log = logging.getLogger("quickdraft.serving")


def serve_replicas(model: str, llm_options: dict[str, Any], served_name: str, limits: ServerLimits,
                   replicas: ReplicaOptions, host: str, port: int, ray_address: str | None = None) -> int:
    import ray
    from ray import serve

    local = ray_address is None
    cpus = replicas.num_cpus * max(replicas.num_replicas, replicas.max_replicas or 0)
    if local:
        ray.init(address="local", num_cpus=max(1, int(-(-cpus // 1))), num_gpus=None if not replicas.num_gpus
                 else int(-(-replicas.num_gpus * replicas.num_replicas // 1)), include_dashboard=False,
                 logging_level=logging.WARNING)
    else:
        ray.init(address=ray_address, logging_level=logging.WARNING)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_app(model, llm_options, served_name, limits, replicas), name=APP_NAME, route_prefix="/")
        where = "a local Ray instance" if local else f"the Ray cluster at {ray_address}"
        print(f"serving {served_name} from {replicas.num_replicas} replicas on {where} at http://{host}:{port}/v1",
              file=sys.stderr, flush=True)
        stop.wait()
    finally:
        try:
            if local:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
        finally:
            ray.shutdown()
    return 0

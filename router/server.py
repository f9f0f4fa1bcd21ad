"""Run the router: uvicorn (uvloop + httptools) serving `router.app.create_app`."""

from __future__ import annotations

import logging
from typing import Any

import uvicorn

from pdcluster.router.app import create_app
from pdcluster.router.cluster import NodeSource
from pdcluster.router.settings import RouterSettings

log = logging.getLogger(__name__)


def uvicorn_config(app: Any, host: str, port: int, log_level: str = "warning") -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, loop="uvloop", http="httptools", log_level=log_level,
                          access_log=False, timeout_graceful_shutdown=5)


def run_router(config: Any, source: NodeSource | None = None) -> None:
    """Serve until SIGINT/SIGTERM. `config`: a `RouterConfig` (what `pdcluster router` loads), a
    `RouterSettings`, or any object with those attribute names.

    Without `source`, nodes come from etcd (`pdcluster.control.cluster_view.ClusterView` on `config.etcd`).
    """
    settings = config if isinstance(config, RouterSettings) else RouterSettings.from_config(config)
    from pdcluster.control.metrics import new_registry

    registry = new_registry()  # shared by the app's metrics and the etcd view's connection gauge
    if source is None:
        from pdcluster.control.cluster_view import ClusterView
        from pdcluster.control.etcd_client import EtcdCredentials

        source = _StartedOnLifespan(ClusterView(list(config.etcd), config.cluster, registry=registry,
                                                credentials=EtcdCredentials.from_config(config)))
    app = create_app(settings, source, registry)
    log.info("router %s serving %s on http://%s:%d (policy %s)", settings.node_id, settings.model,
             settings.host, settings.port, settings.routing_policy)
    uvicorn.Server(uvicorn_config(app, settings.host, settings.port)).run()


class _StartedOnLifespan:
    """A ClusterView the app starts (waiting for the first etcd sync) and stops in its lifespan."""

    def __init__(self, view: Any) -> None:
        self.view = view

    async def start(self) -> None:
        await self.view.start(wait=5.0)

    async def stop(self) -> None:
        await self.view.stop()

    def nodes_by_role(self, role: str) -> list[Any]:
        return self.view.nodes_by_role(role)

    def admin_state(self, node_id: str) -> str:
        return self.view.admin_state(node_id)

"""The HTTP service as a Ray Serve application: each replica runs the FastAPI application of
``mineru_fast.serve`` (``create_app``) unchanged, so API keys, rate and size limits, metrics and
JSON errors are the same as ``mineru-fast serve``. Ray Serve's proxy spreads requests over the
replicas (each holding one model with ``cores_per_replica`` threads) and, with autoscaling, adds
replicas while the ongoing requests per replica stay above the target.

Jobs (``POST /v1/jobs``) are run by the replica that accepted them and recorded in one job store
per application (``job_store``: a Serve deployment-scoped actor), so any replica answers their
status and result; a replica that stops heartbeating has its unfinished jobs taken over by another
(``mineru_fast.serve.store``). Every response names the replica that answered in ``X-Replica-ID``.

Run it with ``mineru-fast serve --ray ...`` or ``serve run mineru_fast.distributed.serve_app:app_builder
model=DIR replicas=2`` (``app_builder``'s arguments).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve import Application

from mineru_fast.distributed import init_ray
from mineru_fast.distributed.job_store import RayJobStore, job_store_actor
from mineru_fast.options import ParserOptions
from mineru_fast.serve.config import ServeConfig

__all__ = ["ParseService", "ReplicaHeader", "build_app", "app_builder", "run"]

REPLICA_HEADER = b"x-replica-id"


class ReplicaHeader:
    """ASGI middleware: adds ``X-Replica-ID: <replica>`` to every HTTP response.

    Args:
        app: the wrapped ASGI application.
        replica: the Serve replica's unique id.
    """

    def __init__(self, app: Any, replica: str) -> None:
        self.app, self.replica = app, replica.encode("ascii")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Pass the request on; stamp the response's start message."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def stamped(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (REPLICA_HEADER, self.replica)]
            await send(message)

        await self.app(scope, receive, stamped)


@serve.deployment(name="mineru-fast", health_check_period_s=10, health_check_timeout_s=30)
@serve.ingress()
class ParseService:
    """One replica: the service application with its own model.

    Args:
        config: the service settings (``ServeConfig``); its options' threads are the replica's CPUs.
    """

    def __init__(self, config: ServeConfig) -> None:
        from mineru_fast.runtime.threads import configure_process

        configure_process(config.options.threads, bind=False)  # before torch loads
        self.config = config
        self.replica: str = serve.get_replica_context().replica_id.unique_id
        self.service_app: Any = None

    def __serve_build_asgi_app__(self) -> Any:
        """The replica's ASGI application (Ray Serve runs its lifespan: model load, canary), its
        jobs in the application's shared store, its responses stamped with ``X-Replica-ID``."""
        from mineru_fast.serve.app import create_app

        # (``app`` is the Serve wrapper's own property)
        self.service_app = create_app(self.config, job_store=RayJobStore(), replica=self.replica)
        self.service_app.add_middleware(ReplicaHeader, replica=self.replica)
        return self.service_app

    def check_health(self) -> None:
        """Ray Serve's periodic check: a replica whose model failed to load is replaced.

        Raises:
            RuntimeError: start-up failed (the error is in the message).
        """
        service = self.service_app.state.service if self.service_app is not None else None
        if service is not None and service.state == "failed":
            raise RuntimeError(f"start-up failed: {service.load_error}")


def build_app(
    config: ServeConfig,
    replicas: int | None = 1,
    cores_per_replica: int = 1,
    autoscaling: tuple[int, int] | None = None,
) -> Application:
    """The bound Serve application.

    Args:
        config: service settings; ``workers`` documents at once per replica, ``queue_size`` waiting.
        replicas: fixed replica count (ignored with ``autoscaling``).
        cores_per_replica: CPUs Ray reserves per replica, and its parser threads.
        autoscaling: ``(min_replicas, max_replicas)``; Serve scales to keep ``config.workers``
            ongoing requests per replica (``target_ongoing_requests``).

    Returns:
        A Serve ``Application`` for ``serve.run``: the replicas and their shared job store
        (``job_store_actor``; results kept ``config.result_ttl`` seconds).
    """
    config = replace(config, options=replace(config.options, threads=cores_per_replica))
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": cores_per_replica},
        "deployment_actors": [job_store_actor(config.result_ttl)],
        # more than the service admits would only queue in the replica: let Serve hold them instead
        "max_ongoing_requests": config.workers + config.queue_size,
    }
    if autoscaling is not None:
        low, high = autoscaling
        options["autoscaling_config"] = {
            "min_replicas": low,
            "max_replicas": high,
            "target_ongoing_requests": config.workers,
        }
    else:
        options["num_replicas"] = replicas
    deployment: Any = ParseService  # a Serve Deployment once decorated
    return deployment.options(**options).bind(config)


def app_builder(args: dict[str, str]) -> Application:
    """``serve run mineru_fast.distributed.serve_app:app_builder key=value ...`` target.

    Keys: ``model`` (required), ``replicas`` (default 1), ``cores_per_replica`` (1),
    ``min_replicas`` + ``max_replicas`` (autoscaling), ``preset`` (fast), ``workers`` (4),
    ``api_key_file``, ``allowed_hosts`` (comma-separated), ``allow_replay`` (``true``).

    Raises:
        ValueError: a missing model or an invalid value.
    """
    if "model" not in args:
        raise ValueError("app_builder needs model=DIR_OR_HUB_ID")
    hosts = args.get("allowed_hosts")
    config = ServeConfig(
        model=args["model"],
        options=ParserOptions.preset(args.get("preset", "fast")),
        workers=int(args.get("workers", 4)),
        api_key_file=Path(args["api_key_file"]) if "api_key_file" in args else None,
        allowed_hosts=tuple(hosts.split(",")) if hosts else None,
        allow_replay=args.get("allow_replay", "false").lower() == "true",
    )
    autoscaling = None
    if "min_replicas" in args or "max_replicas" in args:
        autoscaling = (int(args.get("min_replicas", 1)), int(args.get("max_replicas", 1)))
    return build_app(config, int(args.get("replicas", 1)), int(args.get("cores_per_replica", 1)), autoscaling)


def run(
    config: ServeConfig,
    address: str | None = None,
    replicas: int | None = 1,
    cores_per_replica: int = 1,
    autoscaling: tuple[int, int] | None = None,
) -> int:
    """Run the service on Ray Serve in the foreground until interrupted (``mineru-fast serve --ray``).

    Serve's HTTP proxy listens on ``config.host:config.port``. Connects to ``address`` (a running
    cluster) or starts a local Ray.

    Returns:
        0 after Ctrl-C (the application is deleted and Serve shut down).
    """
    init_ray(address)
    serve.start(http_options={"host": config.host, "port": config.port})
    try:
        serve.run(build_app(config, replicas, cores_per_replica, autoscaling), name="mineru-fast", route_prefix="/",
                  blocking=True)  # fmt: skip
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
    return 0

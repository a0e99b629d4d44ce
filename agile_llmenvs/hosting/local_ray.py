"""The Ray runtime a pool uses, and the local single-node cluster it starts when there is none.

Left to itself, a Ray head started by ``ray.init()`` takes the machine's outward address as its
node address, and its gRPC servers (GCS, raylet, the driver's and every worker's) listen on every
interface: anyone who reaches the machine reaches the cluster, which runs whatever it is sent.
A cluster the pool starts for itself serves this process only, so it listens on loopback.

Ray has no public switch for that. Its node address comes from
``ray._private.services.get_node_ip_address``, which answers 127.0.0.1 when
``ray._private.ray_constants.ENABLE_RAY_CLUSTER`` is false (Ray's own mode for Windows and
macOS, where clusters are off). Ray sets that constant once, when ``ray`` is imported, from
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``, but reads it on every call; so the pool sets it just
for the ``ray.init`` that starts its cluster, whenever ``ray`` was imported, and leaves the
environment alone. Given 127.0.0.1 as their node address, the GCS, the raylet, the runtime
env agent and every worker (each told its node address when spawned) listen on loopback only.
"""

from __future__ import annotations

import contextlib
import importlib
import ipaddress
import logging
import os
from collections.abc import Iterator
from types import ModuleType
from typing import Any

__all__ = ["init_ray"]

logger = logging.getLogger(__name__)


def init_ray(ray: ModuleType, address: str | None) -> None:
    """Connect this process to Ray, unless it is connected already.

    A cluster to connect to (``address``, ``RAY_ADDRESS``, or one ``ray start`` left on this
    machine) is used as it is: how it listens is its own. With none, a local single-node
    cluster is started whose every listener binds loopback (127.0.0.1); a warning says so
    when Ray could not be made to (a Ray without the switch this relies on).

    Args:
        ray: The ``ray`` package.
        address: Ray address to connect to (None: the one Ray finds, or a new local cluster).
    """
    if ray.is_initialized():
        return
    if address is not None or _existing_cluster():
        ray.init(address=address)
        return
    with _loopback_node():
        ray.init(address="local")  # what None means once no cluster was found
    node_ip = str(ray.util.get_node_ip_address())
    if not ipaddress.ip_address(node_ip).is_loopback:
        logger.warning(
            "the local Ray cluster started for the env hosts has the node address %s, so its "
            "GCS, raylet and workers listen on every interface (Ray %s); to choose how Ray "
            "listens, start it yourself before the pool (`ray.init(...)`, or `ray start` and "
            "RAY_ADDRESS)",
            node_ip,
            ray.__version__,
        )


def _existing_cluster() -> bool:
    """Whether ``ray.init()`` would connect to a cluster rather than start one."""
    if os.environ.get("RAY_ADDRESS"):
        return True
    try:
        services = importlib.import_module("ray._private.services")
        return services.canonicalize_bootstrap_address(None) is not None
    except Exception:  # a Ray that finds clusters otherwise: let ray.init decide, as before
        logger.debug("could not tell whether a Ray cluster runs here", exc_info=True)
        return True


@contextlib.contextmanager
def _loopback_node() -> Iterator[None]:
    """Ray's local-only mode, for as long as the block runs (the node address is kept)."""
    constants: Any = importlib.import_module("ray._private.ray_constants")
    if not hasattr(constants, "ENABLE_RAY_CLUSTER"):
        yield  # init_ray warns when the node address is not loopback
        return
    saved = constants.ENABLE_RAY_CLUSTER
    constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        constants.ENABLE_RAY_CLUSTER = saved

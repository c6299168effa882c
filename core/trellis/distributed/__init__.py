"""The single controller: workers, worker groups (in-process and Ray), resource pools, dispatch modes.

from trellis.distributed import Worker, register, Dispatch, LocalWorkerGroup, RayWorkerGroup
"""

from trellis.utils.lazy import lazy_attributes

_LAZY = {
    "Dispatch": "trellis.distributed.dispatch:Dispatch",
    "Execute": "trellis.distributed.dispatch:Execute",
    "register_dispatch_mode": "trellis.distributed.dispatch:register_dispatch_mode",
    "make_nd_compute_dataproto_dispatch_fn": (
        "trellis.distributed.dispatch:make_nd_compute_dataproto_dispatch_fn"
    ),
    "make_nd_compute_metric_dispatch_fn": "trellis.distributed.dispatch:make_nd_compute_metric_dispatch_fn",
    "DataProtoFuture": "trellis.distributed.future:DataProtoFuture",
    "Worker": "trellis.distributed.worker:Worker",
    "register": "trellis.distributed.worker:register",
    "ClassWithInitArgs": "trellis.distributed.worker_group:ClassWithInitArgs",
    "WorkerGroup": "trellis.distributed.worker_group:WorkerGroup",
    "LocalWorkerGroup": "trellis.distributed.worker_group:LocalWorkerGroup",
    "create_colocated_worker_cls": "trellis.distributed.worker_group:create_colocated_worker_cls",
    "RayResourcePool": "trellis.distributed.ray:RayResourcePool",
    "ResourcePoolManager": "trellis.distributed.ray:ResourcePoolManager",
    "RayWorkerGroup": "trellis.distributed.ray:RayWorkerGroup",
    "RayClassWithInitArgs": "trellis.distributed.worker_group:ClassWithInitArgs",
}

__all__ = list(_LAZY)

__getattr__, __dir__ = lazy_attributes("trellis.distributed", _LAZY, globals())

"""Building the DeepSpeed engine: process group, config, optimizer, LR schedule, autocast.

Everything that depends on the machine (CPU or CUDA, bf16 support, one process or a launcher's many) is
decided here, so the learner's update loop has no device branches.

DeepSpeed on CPU and the op we never use: every `deepspeed.initialize` creates a `TorchBackend`
(deepspeed/comm/comm.py:init_distributed), whose constructor calls `build_shm_op()` unconditionally,
whatever the world size. On the CPU accelerator that JIT-compiles the `deepspeed_shm_comm` C++ op with
torch.utils.cpp_extension (24-52 s on 2 Zen 4 cores, more on a slower CPU) the first time on a
machine. That op serves one collective only, `inference_all_reduce` (AutoTP's inference layers), which
falls back to the process group's all_reduce without it; training's collectives (all_reduce,
reduce_scatter, all_gather of ZeRO) are torch.distributed's on the gloo backend either way. So we
declare it unavailable (`deepspeed.ops.__compatible_ops__`, the one switch `build_shm_op` reads) and
nothing is compiled. An op a user's own `train.deepspeed` keys ask for is still JIT-built, once per
machine: torch caches JIT builds in `$TORCH_EXTENSIONS_DIR`, which we point at
`$FACTORY_CACHE/torch_extensions/<env>` unless the user set it. (Optimizer offload needs none: it runs
torch's AdamW, see `deepspeed_config`.)
"""
from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from factory.plan import UpdateSettings


def use_extension_cache() -> str:
    """Point torch's JIT-extension cache at Factory's cache folder (unless the user chose one) so the
    JIT-built ops (CPU Adam, for optimizer offload) are compiled once per machine, not once per run.
    Returns the folder."""
    import hashlib
    import sys

    from factory.assets import cache_dir

    # One folder per Python environment: the build records the sources' paths inside the venv, so two
    # checkouts sharing one folder rebuild the op (~50 s) each time the other one ran.
    env = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
    return os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(cache_dir() / "torch_extensions" / env))


def init_process_group() -> None:
    """Join (or make) the torch.distributed group DeepSpeed needs.

    Under a launcher (torchrun, `deepspeed`, WORLD_SIZE > 1) its env vars are used as they are. Alone,
    we are a world of one: there is nobody to meet, so the group is made on an in-memory store rather
    than env:// (whose TCPStore listens on every interface), and a second learner in the same process
    (tests, a restart) never meets a port in TIME_WAIT. A world Factory sets up itself (MASTER_ADDR etc.
    from the update stage, no torchrun) meets on a store served on rank 0's address alone
    (`rendezvous_store`). The backend is the accelerator's: gloo on CPU, nccl on CUDA."""
    import deepspeed

    if torch.distributed.is_initialized():
        return
    use_extension_cache()
    backend = deepspeed.get_accelerator().communication_backend_name()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and "MASTER_ADDR" in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ:
        # Factory's own world (the update stage's replicas, factory.update.stage), not a launcher's: the
        # rendezvous store listens on rank 0's node address alone -- loopback on a local Ray -- where
        # env:// would listen on every interface, and gloo's and NCCL's own sockets stay there too.
        addr, port, rank = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["RANK"])
        for key, value in loopback_sockets(addr).items():
            os.environ.setdefault(key, value)
        store = rendezvous_store(addr, port, rank, world)
        torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world,
                                             device_id=bound_device(backend, world))
    elif world == 1:
        # DeepSpeed reads its rank from the environment; what we add is taken away again by
        # release_process_group, so a later library in this process (accelerate, a test) does not take a
        # half-set launcher environment for a distributed job.
        own = {k: v for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items() if k not in os.environ}
        os.environ.update(own)
        _ENV_SET_BY_US.update(own)
        torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
        if backend == "nccl":
            quiet_single_rank_barrier()
    skip_shm_op()
    quiet_deprecated_collectives()
    deepspeed.init_distributed(dist_backend=backend, verbose=False)  # adopts an initialised group as it is


def bound_device(backend: str, world: int) -> torch.device | None:
    """The GPU a world's process group is bound to (`device_id` of torch's init_process_group), or None.

    NCCL with 2+ ranks: the rank's own GPU, LOCAL_RANK's (0 under Ray, which shows each rank its GPU alone),
    as DeepSpeed's own init binds it when it makes the group (we make it ourselves, so we must say it). Bound,
    NCCL's communicator is made at once, so a broken NCCL fails at start-up rather than at the first
    collective, and every barrier() runs on that GPU; unbound, torch guesses the device and warns "barrier():
    using the device under current context" on every rank-0 process. Not in a world of one, which DeepSpeed
    also leaves unbound (deepspeed#8248: a bound one-rank group builds its sub-groups with ncclCommSplit,
    which failed on single-GPU machines), nor on gloo, which computes on the CPU."""
    if backend != "nccl" or world < 2:
        return None
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def quiet_single_rank_barrier() -> None:
    """A world of one on CUDA stays unbound (`bound_device`), so torch warns at DeepSpeed's first barrier
    (a checkpoint's) that it uses "the device under current context". That device is the engine's GPU, the
    one device of that world (DeepSpeed made LOCAL_RANK's current), so the warning, printed once by every
    update process, is noise no user can act on. Only that message is silenced."""
    warnings.filterwarnings("ignore", category=UserWarning,
                            message=r"barrier\(\): using the device under current context")


def quiet_deprecated_collectives() -> None:
    """ZeRO with 2+ ranks calls torch.distributed's all_gather_into_tensor and reduce_scatter_tensor, which
    torch 2.13 deprecates for their `_single` forms: a FutureWarning in the run's display that no user can
    act on (DeepSpeed's call, not theirs). Only those two messages are silenced."""
    deprecated = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
    warnings.filterwarnings("ignore", category=FutureWarning, message=deprecated)


_ENV_SET_BY_US: dict[str, str] = {}


def skip_shm_op() -> None:
    """Tell DeepSpeed its shm_comm op is unavailable, so `TorchBackend` does not JIT-compile it (module
    docstring): only `inference_all_reduce` uses it, and that falls back to the process group's
    all_reduce."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def loopback_sockets(addr: str) -> dict[str, str]:
    """The environment that keeps a world's collective sockets on loopback when it meets there (a local
    Ray): gloo's pairs and NCCL's bootstrap and socket transport listen on an interface of their own choosing,
    for NCCL the machine's first one that is not loopback, where nothing else of the run listens (the ranks of
    one machine talk over NVLink or shared memory anyway). {} for a cluster's address."""
    return {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"} if is_loopback(addr) else {}


def is_loopback(addr: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


def rendezvous_store(addr: str, port: int, rank: int, world: int,
                     timeout_s: float = 300.0) -> torch.distributed.TCPStore:
    """The world's key-value store, rank 0 serving it on `addr` alone (torch's own TCPStore server binds
    every interface: it is given a socket bound here instead); the other ranks connect to it."""
    import datetime
    import socket

    listen_fd = None
    if rank == 0:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(max(world, 16))
        listen_fd = sock.detach()  # the store owns it from here
    return torch.distributed.TCPStore(addr, port, world, rank == 0, timeout=datetime.timedelta(seconds=timeout_s),
                                      master_listen_fd=listen_fd)


def release_process_group() -> None:
    """Destroy the process group and take back the environment init_process_group added."""
    if torch.distributed.is_initialized():
        import deepspeed.comm as dist

        dist.destroy_process_group()  # DeepSpeed's: also forgets the sub-groups it cached
    for key, value in list(_ENV_SET_BY_US.items()):
        if os.environ.get(key) == value:
            del os.environ[key]
        del _ENV_SET_BY_US[key]


def on_cuda() -> bool:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cuda"


def autocast_dtype(spec: UpdateSettings) -> torch.dtype | None:
    """bf16 autocast when asked and the update's device computes bf16 natively (factory.device's one rule,
    on the slice's `compute`); None = run in the weights' dtype. Only for fp32 weights: bf16/fp16 weights
    (model.dtype) are DeepSpeed's mixed precision instead (the compiler then asks for no autocast)."""
    from factory.device import resolve_dtype

    return torch.bfloat16 if resolve_dtype(spec.compute) == "bfloat16" else None


def autocast(device_type: str, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def deepspeed_config(spec: UpdateSettings) -> dict[str, Any]:
    """The DeepSpeed config for a spec: ZeRO stage, micro batch, clipping, precision; then every extra
    key of `train.deepspeed` merged on top (so any DeepSpeed setting is reachable from the spec).

    Gradient accumulation is caller-owned (`managed_gradient_accumulation: false`): a mini-batch has as
    many micro-batches as its size needs, each `engine.backward` accumulates without rescaling, and one
    `engine.step` per mini-batch reduces, clips and steps. The loss is already normalised by the
    mini-batch totals (see factory.algorithms AGGREGATIONS), so the accumulated gradient is exact."""
    ds = spec.train.deepspeed
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": spec.train.micro_batch,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": spec.train.optimizer.grad_clip,
        "zero_optimization": zero,
        "steps_per_print": 2**31 - 1,  # we report our own metrics; DeepSpeed's progress lines are noise
        "wall_clock_breakdown": False,
    }
    if spec.model.dtype == "bfloat16":
        cfg["bf16"] = {"enabled": True}
    elif spec.model.dtype == "float16":
        cfg["fp16"] = {"enabled": True}
    if spec.train.optimizer.name != "adamw":
        cfg["zero_allow_untested_optimizer"] = True  # ZeRO refuses torch optimizers it has no test for
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
        # DeepSpeed insists on its own CPU Adam with offload (a 60 s first-use build); torch's AdamW on
        # the offloaded fp32 states is correct, just slower per step.
        cfg["zero_force_ds_cpu_optimizer"] = False
    return _deep_merge(cfg, dict(ds.model_extra or {}))


@contextlib.contextmanager
def partitioned_loading(config: dict[str, Any]) -> Iterator[None]:
    """Under ZeRO-3, models built inside are partitioned as they are built (DeepSpeed's `zero.Init`, which
    transformers' `from_pretrained` enters while `HfDeepSpeedConfig` says ZeRO-3): each rank then holds
    its 1/world of the float32 weights while loading, instead of a whole copy first (a 4B model is 16 GB
    of host memory per rank, 8 ranks to a node). PEFT gathers a partitioned layer's weight while it adds
    adapters, by the same signal. transformers reads that signal through a module-level weak reference,
    unset on the way out: a model loaded afterwards in this process (the reference model, a test's second
    learner) is a whole copy. Other stages: nothing."""
    if config["zero_optimization"]["stage"] != 3:
        yield
        return
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    hold = HfDeepSpeedConfig(config)  # noqa: F841 -- registered by its constructor; alive until the finally
    try:
        yield
    finally:
        unset_hf_deepspeed_config()


def make_optimizer(spec: UpdateSettings, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """A client torch optimizer: DeepSpeed's own Adam variants JIT-compile for 60-96 s on first use."""
    o = spec.train.optimizer
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=spec.train.lr, weight_decay=o.weight_decay)
    # foreach=False: the multi-tensor path gains nothing on CPU and keeps extra copies of every state.
    return torch.optim.AdamW(params, lr=spec.train.lr, betas=o.betas, weight_decay=o.weight_decay,
                             foreach=on_cuda())


def learning_rate(spec: UpdateSettings, step: int) -> float:
    """The LR of training step `step` (1-based): linear warmup over `train.warmup_steps` training steps
    (what users count), then constant. Set on the optimizer at the start of each training step rather
    than by a per-update scheduler, so epochs x mini-batches (which can shrink when few trajectories
    are kept) never shift the warmup, and a resumed run needs no scheduler state."""
    warmup = spec.train.warmup_steps
    return spec.train.lr * (min(1.0, step / warmup) if warmup > 0 else 1.0)

"""Training engines: forward/backward passes, optimizer steps and sequence packing for the policy and
critic models.

An engine holds one model for one role (``actor``, ``critic`` or ``ref``) and is selected by
name from the ``trellis.training_engines`` registry: ``single`` (one process) or ``fsdp``
(FSDP2 over ``torch.distributed``). One optimizer step::

    from trellis.registries import training_engines

    Engine = training_engines.get(config.actor.engine)
    engine = Engine(config.model, config.actor, role="actor", total_steps=n)
    with engine.phase():                                   # offloaded weights come in (actor.offload)
        old = engine.forward(batch)["log_probs"]           # (bs, T), no gradient
    with engine.phase(optimizer=True):                     # ... and the optimizer state
        engine.zero_grad()
        metrics = engine.forward_backward(batch, loss_fn)  # loss_fn(outputs, micro_batch, global_batch_info)
        metrics |= engine.optimizer_step()                 # grad_norm, lr, stepped
    weights = dict(engine.iter_full_params())              # Hugging Face names, for weight sync

Modules: ``base`` (the contract and shared machinery), ``single``, ``fsdp``, ``models`` (causal
LM and value model loading), ``optim`` (AdamW and the lr schedule), ``micro_batch`` (grouping
and global counts), ``packing`` (padding-free sequences). Names below import on first access.
"""

from __future__ import annotations

from trellis.utils.lazy import lazy_attributes

# public name -> "module:attr", imported on first access
_LAZY: dict[str, str] = {
    "TrainingEngine": "trellis.engine.base:TrainingEngine",
    "EngineError": "trellis.engine.base:EngineError",
    "SingleEngine": "trellis.engine.single:SingleEngine",
    "FSDPEngine": "trellis.engine.fsdp:FSDPEngine",
    "build_optimizer": "trellis.engine.optim:build_optimizer",
    "build_lr_scheduler": "trellis.engine.optim:build_lr_scheduler",
    "LRSchedule": "trellis.engine.optim:LRSchedule",
    "PackedBatch": "trellis.engine.packing:PackedBatch",
    "pack": "trellis.engine.packing:pack",
    "unpack": "trellis.engine.packing:unpack",
    "split_by_token_budget": "trellis.engine.packing:split_by_token_budget",
    "restore_order": "trellis.engine.packing:restore_order",
}

__all__ = list(_LAZY)

__getattr__, __dir__ = lazy_attributes("trellis.engine", _LAZY, globals())

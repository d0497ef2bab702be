"""Who runs the model's steps under ``NDParallelStrategy``: the hooks between Lightning's loops and
the (sharded) LightningModule.

Lightning calls the strategy's ``training_step`` and then ``strategy.backward`` separately.
FSDP needs the steps entered through the root module's ``__call__`` when the LightningModule
itself is the root, its gradient reduction chosen per micro-batch of an accumulation window
(``block_backward_sync``), and its gathered parameters freed after forward-only evaluation. Loss parallel needs one context around the loss and its
backward: Lightning runs them in two calls (``training_step``, then ``backward``), so the strategy
enters ``loss_parallel()`` in both. Pipeline parallel, which runs forward and backward of every
micro-batch in one schedule, owns the whole step: ``pipeline_steps.PipelineStepMixin``.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from typing import Any

from torch.distributed.tensor.parallel import loss_parallel

from typing_extensions import override

from lightning_disttrain.parallel.fsdp import reshard, set_gradient_sync, set_replica_all_reduce
from lightning_disttrain import _lightning_compat as compat


class StepMixin:
    """Step hooks of ``NDParallelStrategy``; mixed in before Lightning's ``ParallelStrategy``.

    Reads ``lightning_module``, ``precision_plugin``, ``_forward_redirection`` (Lightning's) and
    ``_root_is_lightning_module`` (set when the model is parallelized).
    """

    _root_is_lightning_module: bool = False
    """True when no submodule holds all parameters, so FSDP's root is the LightningModule itself
    and its ``*_step`` methods must be entered through ``__call__`` for FSDP's hooks to run."""

    _self_parallelized: str = ""
    """How the module parallelized itself in ``configure_model`` (``recipe.Parallelized``)."""

    _gradient_sync_blocked: bool = False
    """True inside ``block_backward_sync`` when the micro-batch keeps its gradients unreduced
    (``accumulate_unsharded_grads``): a batch of an accumulation window but its last."""

    accumulate_unsharded_grads: bool = False
    """The strategy's option (``NDParallelStrategy``): skip the reduce-scatter inside an
    accumulation window (unsharded gradients held) instead of reducing every micro-batch."""

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning enters this for every micro-batch but the last of an accumulation window
        (``_block_parallel_sync_behavior`` in the automatic loop; ``toggle_model`` in manual
        optimization).

        By default the gradients stay sharded: every micro-batch's backward reduce-scatters, and
        FSDP adds the shard to the one the parameter holds (ZeRO-2/3's and torchtitan's way:
        k reduce-scatters per window, nothing unsharded held between micro-batches). Only HSDP's
        all-reduce across replicas waits for the last micro-batch (FSDP keeps the partial sum,
        sharded). With ``accumulate_unsharded_grads`` FSDP skips the reduce-scatter too: each unit
        keeps the whole unsharded gradient (fp32) until the last micro-batch's backward reduces the
        sum once. Under pipeline parallel the schedule sets FSDP's sync itself and reduces at the
        end of each step: ``_gradient_sync_blocked`` tells the pipeline step to keep the step's
        gradients unreduced instead (``pipeline_steps``), with ``accumulate_unsharded_grads`` only.
        """
        module = self.lightning_module
        if not self.accumulate_unsharded_grads:
            pipeline = getattr(self, "_pipeline", None) is not None  # torch's stage turns all syncs on itself
            if not pipeline:
                set_replica_all_reduce(module, False)
            try:
                yield None
            finally:
                if not pipeline:
                    set_replica_all_reduce(module, True)
            return
        set_gradient_sync(module, False)
        self._gradient_sync_blocked = True
        try:
            yield None
        finally:
            self._gradient_sync_blocked = False
            set_gradient_sync(module, True)

    @property
    def loss_parallel_enabled(self) -> bool:
        """Tensor parallel with vocabulary-sharded logits: the loss (forward and backward) must run
        under ``loss_parallel()``, which the strategy enters around each step and its backward."""
        dims = getattr(self, "_parallel_dims", None)
        # A module that parallelized itself owns its loss: it enters loss_parallel() itself (the
        # context does not nest), as under Lightning's ModelParallelStrategy.
        return (dims is not None and dims.tp_enabled and self.tp_options.loss_parallel
                and not self._self_parallelized)

    @property
    def sequence_multiple(self) -> int:
        """What the sequence length must be a multiple of (tp under sequence parallel, else 1)."""
        dims = getattr(self, "_parallel_dims", None)
        return dims.tp if dims is not None and dims.tp_enabled and self.tp_options.sequence_parallel else 1

    def _loss_context(self):
        return loss_parallel() if self.loss_parallel_enabled else nullcontext()

    @override
    def backward(self, closure_loss, optimizer, *args: Any, **kwargs: Any):
        with self._loss_context():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _step(self, method: str, context, *args: Any, **kwargs: Any) -> Any:
        with context(), self._loss_context():
            if self._root_is_lightning_module:
                # FSDP's root hooks fire in __call__: enter *_step through the module's forward.
                return compat.forward_redirection(self, self.lightning_module, self.lightning_module, method,
                                                  *args, **kwargs)
            return getattr(self.lightning_module, method)(*args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("training_step", self.precision_plugin.train_step_context, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("validation_step", self.precision_plugin.val_step_context, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("test_step", self.precision_plugin.test_step_context, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("predict_step", self.precision_plugin.predict_step_context, *args, **kwargs)

    @override
    def on_validation_end(self) -> None:
        # Evaluation runs forward only, so nothing reshards the units that keep their parameters
        # gathered for the backward; they would stay gathered into the next training steps (or,
        # after test/predict, to the end of the run).
        reshard(self.lightning_module)

    on_test_end = on_predict_end = on_validation_end

"""Who runs the step under pipeline parallel (pp > 1): the strategy, through a schedule.

A pipeline schedule runs forward *and* backward of every micro-batch in one call, and each rank
holds only some stages, so neither the LightningModule's ``training_step`` (one forward of the
whole model) nor Lightning's separate ``backward`` can run. Under pp the strategy:

1. splits the batch into ``(inputs, targets)`` (``module.pipeline_batch(batch)`` if defined, else
   ``batch[0], batch[1]``) and runs the schedule; on the last stage each micro-batch's loss is
   ``module.pipeline_loss(output, target)`` (a mean over the micro-batch), differentiated
   as ``loss / (micro-batches x accumulate_grad_batches)`` so the gradients are those of the
   batch's mean loss, as without pp;
2. auxiliary losses computed inside the stages (a mixture of experts' balance and z losses), when
   the module defines ``pipeline_aux_loss(stage_module)`` (the stage's auxiliary loss of its last
   forward, or None): every stage adds their gradient to its own backward, scaled like the loss
   (``PipelineRunner``), so the objective is the one of ``training_step`` without pp, which adds
   them to the loss on one process;
3. sends the mean of the micro-batch losses from the last stage to every rank of the pipeline, and
   the auxiliary losses summed over the stages (each stage's mean over the micro-batches), in one
   all-reduce over the pipeline group;
4. calls ``module.pipeline_training_step(batch, batch_idx, loss)`` (with ``aux_loss=`` when the
   module defines ``pipeline_aux_loss``) where the module logs what its ``training_step`` would
   (default: ``train/loss``) and returns the loss it differentiated (default: ``loss`` plus
   ``aux_loss``);
5. skips the backward Lightning then asks for (already done), but still runs the
   ``on_before_backward`` / ``on_after_backward`` hooks (both after the schedule's backward).

Gradient accumulation: a schedule step ends with FSDP's reduce-scatter of the step's gradients;
inside an accumulation window (Lightning's ``block_backward_sync``) the strategy has the stages
keep them unreduced instead, so the window's last step reduces their sum once per optimizer step.
The MoE balancing loads and QK-clip's largest logits: the schedule's first step probes the stages'
shapes with a forward and backward of their own, whose routing and logits the strategy discards
(``PipelineRunner.state_guard``); the bias update then counts exactly the micro-batches' tokens,
and the clip sees exactly their logits, as without pp.

Gradients: Lightning zeroes them *between* ``training_step`` and ``backward`` (to free them
before the backward's peak), which under pp would discard what the schedule just computed. So on
the first batch of each accumulation window the strategy zeroes them before the schedule, and the
optimizer's ``zero_grad`` that Lightning calls next does nothing that once. Manual optimization
is not supported under pp.

Validation and test run forward-only schedules the same way (``pipeline_validation_step`` /
``pipeline_test_step``, default: ``val/loss`` / ``test/loss``); a batch that does not split into
the micro-batches is padded with ignored rows (targets -100). ``pipeline_logits`` serves
``generate``. The optimizer step, schedulers, clipping (norm over all stages), accumulation,
checkpoints and loggers are Lightning's, unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from typing_extensions import override

from lightning_disttrain import comm
from lightning_disttrain import _lightning_compat as compat
from lightning_disttrain.parallel.pipeline import PipelineOptions, PipelineRunner, split_blocks, split_model, stage_ids
from lightning_disttrain.parallel.plan import find_parallel_plan

IGNORE = -100  # F.cross_entropy's ignore_index: padded evaluation rows
SCALAR = ((), torch.float32)  # what a step's loss is on every rank


class PipelineStepMixin:
    """Pipeline steps of ``NDParallelStrategy``; mixed in before ``StepMixin``."""

    pp_options: PipelineOptions
    _pipeline: PipelineRunner | None = None
    _skip_zero_grad: bool = False

    @property
    def pipeline_enabled(self) -> bool:
        dims = getattr(self, "_parallel_dims", None)
        return dims is not None and dims.pp_enabled

    @property
    def pipeline_stage_modules(self) -> list[nn.Module]:
        """The modules this rank runs as stages (views over the LightningModule's model)."""
        return [] if self._pipeline is None else list(self._pipeline.modules)

    # -- checks and the split ---------------------------------------------------------------

    def _validate_pipeline_early(self, module, config) -> None:
        """Before the process group: bad layouts as ValueErrors on every rank at once."""
        pp = self.parallel_dims.pp
        plan_fn = getattr(module, "parallel_plan", None)
        if not callable(plan_fn):
            raise ValueError(f"pp={pp} needs a pipeline plan: define {type(module).__name__}.parallel_plan() returning a "
                             f"ParallelPlan with pipeline=PipelinePlan(...) (see parallel/pipeline.py), or set pp=1")
        if not callable(getattr(module, "pipeline_loss", None)):
            raise ValueError(f"pp={pp} needs {type(module).__name__}.pipeline_loss(output, target): the mean loss of one "
                             f"micro-batch, computed on the last stage (see strategies/pipeline_steps.py)")
        if getattr(config, "tie_embeddings", False):
            raise ValueError(f"pp={pp} puts the token embedding on the first stage and the head on the last, so they "
                             f"cannot share a weight: set tie_embeddings=False in the model config "
                             f"(--model.init_args.model_overrides.tie_embeddings false), or pp=1")
        if not getattr(module, "automatic_optimization", True):
            raise ValueError(f"pp={pp} runs forward and backward inside the pipeline schedule, so manual optimization "
                             f"(automatic_optimization=False) cannot call backward itself; use automatic "
                             f"optimization, or pp=1")
        n_layer = getattr(config, "n_layer", None)
        dm = getattr(compat.trainer_of(module), "datamodule", None)
        batch = getattr(dm, "batch_size", None)
        self.pp_options.validate(pp, n_layer if isinstance(n_layer, int) else None,
                                 batch if isinstance(batch, int) else None)

    def _split_pipeline(self, module: nn.Module) -> str:
        """Keep this rank's stages of ``module`` (in place) and build their runner."""
        dims, options = self.parallel_dims, self.pp_options
        plan = find_parallel_plan(module)
        if plan.pipeline is None:
            raise ValueError(f"pp={dims.pp} needs {type(module).__name__}.parallel_plan() to set "
                             f"pipeline=PipelinePlan(module=..., first=(...), last=(...))")
        n_blocks = len(plan.block_list)
        options.validate(dims.pp, n_blocks)
        n_stages = options.num_stages(dims.pp)
        ranges = split_blocks(n_blocks, n_stages, options.split_points, options.edge_cost)
        pp_mesh = dims.get_mesh("pp")
        local = stage_ids(pp_mesh.get_local_rank(), dims.pp, options)
        modules = split_model(plan.pipeline, plan.blocks, ranges, local)  # checks the blocks are a ModuleDict
        keys = plan.blocks._ldt_all_keys
        self._pipeline = PipelineRunner(modules, local, n_stages, options, dims.pp, pp_mesh.get_group(),
                                        self.root_device)
        aux_loss = getattr(module, "pipeline_aux_loss", None)
        self._pipeline.aux_loss = aux_loss if callable(aux_loss) else None
        self._pipeline.state_guard = _probe_guard(modules)
        held = ", ".join(f"stage {s} (blocks {keys[ranges[s][0]]}-{keys[ranges[s][-1]]})" for s in local)
        return (f"pipeline: {options.schedule}, {n_stages} stages of {n_blocks} blocks "
                f"{[len(r) for r in ranges]}, {self._pipeline.microbatches} micro-batches; this rank: {held}")

    def _guard_zero_grad(self) -> None:
        """Make each optimizer's ``zero_grad`` skip once after the schedule ran (see the module doc)."""
        for optimizer in getattr(self, "optimizers", []):
            if getattr(optimizer, "_ldt_guarded", False):
                continue
            original = optimizer.zero_grad

            def zero_grad(*args, _original=original, **kwargs):
                if self._skip_zero_grad:
                    self._skip_zero_grad = False
                    return None
                return _original(*args, **kwargs)

            optimizer.zero_grad = zero_grad
            optimizer._ldt_guarded = True

    # -- the steps --------------------------------------------------------------------------

    def _batch(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        fn = getattr(self.lightning_module, "pipeline_batch", None)
        if callable(fn):
            return fn(batch)
        return batch[0], batch[1]

    def _from_last_stage(self, value: torch.Tensor | None, meta: tuple | None = None) -> torch.Tensor:
        """``value`` from the rank holding the last stage, on every rank of the pipeline.
        ``meta`` = (shape, dtype) when the other ranks know it (a loss); else it is sent first."""
        runner = self._pipeline
        assert runner is not None
        if meta is None:
            meta = comm.broadcast_object(None if value is None else (tuple(value.shape), value.dtype),
                                         group_src=runner.last_rank, group=runner.group)
        shape, dtype = meta
        out = value.contiguous() if value is not None else torch.empty(shape, dtype=dtype, device=self.root_device)
        return comm.broadcast(out, group_src=runner.last_rank, group=runner.group)

    def _pipeline_train(self, batch: Any, batch_idx: int) -> Any:
        module, runner = self.lightning_module, self._pipeline
        inputs, targets = self._batch(batch)
        accumulate = max(1, int(module.trainer.accumulate_grad_batches))
        scale = runner.microbatches * accumulate
        if batch_idx % accumulate == 0:  # Lightning's own zero_grad comes after this step: see above
            for optimizer in self.optimizers:
                optimizer.zero_grad(set_to_none=True)
            self._skip_zero_grad = True
        losses: list[torch.Tensor] = []

        def loss_fn(output, target):
            loss = module.pipeline_loss(output, target)
            losses.append(loss.detach())
            return loss / scale

        # Inside an accumulation window the step keeps FSDP's gradients unreduced (see the module doc).
        runner.sync_gradients = not self._gradient_sync_blocked
        with self.precision_plugin.train_step_context(), self._loss_context():
            runner.run(inputs, targets, loss_fn, train=True, aux_weight=1.0 / scale)
        # The stages' first step also runs the loss once to infer shapes: the batch's are the last m.
        # The loss from the last stage and the auxiliary losses of every stage, summed, in one
        # all-reduce over the pipeline (the other ranks add zeros to the loss).
        mean = torch.stack(losses[-runner.microbatches:]).mean().float() if runner.has_last else None
        both = torch.stack([torch.zeros((), device=self.root_device) if mean is None else mean.detach(),
                            runner.aux_mean.to(self.root_device)])
        loss, aux = comm.all_reduce(both, "sum", group=runner.group).unbind()
        hook = getattr(module, "pipeline_training_step", None)
        with_aux = runner.aux_loss is not None
        if callable(hook):
            return hook(batch, batch_idx, loss, aux_loss=aux) if with_aux else hook(batch, batch_idx, loss)
        module.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False, sync_dist=True)
        return loss + aux if with_aux else loss

    def _pipeline_eval(self, inputs: torch.Tensor, targets: torch.Tensor, fn) -> list:
        """Forward-only: ``fn(output, target)`` on the last stage for each micro-batch; the batch is
        padded to a multiple of the micro-batches (repeated inputs, ignored targets)."""
        runner = self._pipeline
        pad = (-inputs.size(0)) % runner.microbatches
        if pad:
            inputs = torch.cat([inputs, inputs[-1:].expand(pad, *inputs.shape[1:])])
            targets = torch.cat([targets, torch.full((pad, *targets.shape[1:]), IGNORE, dtype=targets.dtype,
                                                     device=targets.device)])
        results: list = []

        def loss_fn(output, target):
            results.append(fn(output, target))
            return torch.zeros((), device=self.root_device)

        with self._loss_context():
            runner.run(inputs, targets, loss_fn, train=False)
        return results[-runner.microbatches:] if runner.has_last else []

    def _pipeline_evaluate(self, hook_name: str, key: str, context, batch: Any, batch_idx: int) -> Any:
        module = self.lightning_module
        inputs, targets = self._batch(batch)

        def weighted(output, target):
            n = (target != IGNORE).sum()
            loss = module.pipeline_loss(output, target).detach().float() if n else torch.zeros(())
            return loss * n, n

        with context():
            parts = self._pipeline_eval(inputs, targets, weighted)
        mean = (sum(p[0] for p in parts) / sum(p[1] for p in parts)).reshape(()).float() if parts else None
        loss = self._from_last_stage(mean, SCALAR)
        hook = getattr(module, hook_name, None)
        if callable(hook):
            return hook(batch, batch_idx, loss)
        module.log(key, loss, prog_bar=key == "val/loss", on_step=False, on_epoch=True, sync_dist=True)
        return None

    def pipeline_logits(self, idx: torch.Tensor, position: int) -> torch.Tensor:
        """The last stage's output at ``position`` of each sequence of ``idx`` (B, T), whole (a
        DTensor gathered), on every rank of the pipeline. Collective over the pipeline group."""
        B = idx.size(0)
        dummy = torch.zeros_like(idx)

        def at_position(output, target):
            out = output[:, position]
            return out.full_tensor() if hasattr(out, "full_tensor") else out

        with torch.no_grad():
            parts = self._pipeline_eval(idx, dummy, at_position)
        return self._from_last_stage(torch.cat(parts)[:B] if parts else None)

    def pipeline_forward(self, idx: torch.Tensor) -> torch.Tensor:
        """The last stage's whole output for ``idx`` (B, T), e.g. logits (B, T, V), whole (a DTensor
        gathered), on every rank of the pipeline: a forward-only schedule (evaluation). Collective
        over the pipeline group: every rank calls it with the same ``idx``."""
        B = idx.size(0)

        def whole(output, target):
            return output.full_tensor() if hasattr(output, "full_tensor") else output

        with torch.no_grad():
            parts = self._pipeline_eval(idx, torch.zeros_like(idx), whole)
        return self._from_last_stage(torch.cat(parts)[:B] if parts else None)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            return self._pipeline_train(*args, **kwargs)
        return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            return self._pipeline_evaluate("pipeline_validation_step", "val/loss",
                                           self.precision_plugin.val_step_context, *args, **kwargs)
        return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            return self._pipeline_evaluate("pipeline_test_step", "test/loss",
                                           self.precision_plugin.test_step_context, *args, **kwargs)
        return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            raise ValueError("trainer.predict is not supported under pp > 1 (no rank holds the whole model); "
                             "use GPTModule.generate, trainer.validate / test, or pp=1")
        return super().predict_step(*args, **kwargs)

    @override
    def backward(self, closure_loss, optimizer, *args: Any, **kwargs: Any):
        if self._pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # The schedule ran every backward already; keep Lightning's hooks around where it was.
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        return self.precision_plugin.post_backward(closure_loss, module)

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        from lightning_disttrain.parallel.fsdp import reshard

        stages = self.pipeline_stage_modules
        if len(stages) > 1:  # views outside the LightningModule, each its own FSDP root (one stage: the model)
            for stage in stages:
                reshard(stage)

    on_test_end = on_predict_end = on_validation_end


def _probe_guard(stages: list[nn.Module]):
    """``PipelineRunner.state_guard`` for what the stages record while training, saved and
    restored so that the schedule's shape probing (a forward and backward of made-up activations)
    is not counted: the mixture-of-experts layers' per-expert loads for the balancing bias
    (``MoE._pending_load``) and, under QK-clip, the attention layers' largest logits
    (``CausalSelfAttention.max_logit``). None when the stages hold neither kind of layer."""
    from lightning_disttrain.models.gpt import CausalSelfAttention
    from lightning_disttrain.models.moe import MoE

    recorded = ((MoE, "_pending_load"), (CausalSelfAttention, "max_logit"))
    layers = [(m, name) for stage in stages for m in stage.modules() for kind, name in recorded if isinstance(m, kind)]
    if not layers:
        return None

    def snapshot():
        saved = [(layer, name, getattr(layer, name)) for layer, name in layers]

        def restore() -> None:
            for layer, name, value in saved:
                setattr(layer, name, value)

        return restore

    return snapshot

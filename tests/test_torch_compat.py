"""The torch seam (``lightning_disttrain/_torch_compat.py``): every private it relies on exists in
the installed torch, each accessor works on a tiny real object, and a private that is gone (a
``monkeypatch.delattr`` on torch's own attribute) fails with a ``TorchCompatError`` naming it, the
installed torch and the checked versions, never a silent fallback. The symmetric-memory call runs
below torch 2.13 only."""

from __future__ import annotations

import re
import warnings
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from lightning_disttrain import _torch_compat as compat


@pytest.fixture
def mesh(one_rank_group):
    """A 1-rank gloo mesh with two named dimensions."""
    return init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "b"))


def gone(name: str):
    """``pytest.raises`` for the clear error about private ``name``."""
    return pytest.raises(compat.TorchCompatError, match=re.escape(name) + r".*installed torch "
                         + re.escape(str(torch.__version__)) + r".*checked against torch 2\.13\.0")


# -- the check ----------------------------------------------------------------------------------


def test_check_passes_on_the_installed_torch():
    assert compat.check() is None
    assert issubclass(compat.TorchCompatError, RuntimeError)


@pytest.mark.parametrize("private", compat.PRIVATES, ids=compat.PRIVATE_NAMES)
def test_every_private_resolves(private):
    assert private.why and private.replacement
    if compat.relied_on(private):
        private.probe()


def test_check_names_every_missing_private(monkeypatch):
    import torch.utils._pytree as pytree

    monkeypatch.delattr(pytree, "tree_leaves")
    monkeypatch.delattr(DeviceMesh, "_flatten")
    with gone("torch.utils._pytree.tree_leaves") as err:
        compat.check()
    assert "DeviceMesh._flatten" in str(err.value)


def test_the_version_guard_warns_once_on_an_unchecked_torch(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    monkeypatch.setattr(compat, "_WARNED", set())
    with pytest.warns(compat.TorchCompatWarning, match="installed torch 2.99.0 is not among them"):
        assert compat.tree_leaves([1, 2]) == [1, 2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.tree_leaves([1])  # once per process


def test_torch_version():
    assert compat.torch_version() >= (2, 13)


# -- dispatch, pytree, ops, autograd, FLOPs -------------------------------------------------------


def test_tree_leaves_and_dispatch_mode():
    t = torch.ones(2)
    assert compat.tree_leaves(((1, [t]), {"k": 2})) == [1, t, 2]

    class Ops(compat.TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func)
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        t.add_(1)
    assert torch.ops.aten.add_.Tensor in ops.seen


def test_op_schema_tells_what_an_op_writes():
    written = [a.name for a in compat.op_schema(torch.ops.aten.add_.Tensor).arguments
               if a.alias_info is not None and a.alias_info.is_write]
    assert written == ["self"]


def test_current_graph_task_id_inside_and_outside_backward():
    assert compat.current_graph_task_id() == -1
    inside = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: inside.append(compat.current_graph_task_id()))
    y.sum().backward()
    assert inside and inside[0] != -1


def test_a_formula_passed_through_gets_the_op_arguments(monkeypatch):
    from torch.utils.flop_counter import FlopCounterMode

    seen = []

    def formula(*args, **kwargs):
        seen.append(type(args[0]))
        return 7

    counter = FlopCounterMode(display=False, custom_mapping={
        torch.ops.aten.mm: compat.pass_flop_formula_through(formula)})
    with counter:
        torch.mm(torch.ones(2, 3), torch.ones(3, 4))
    assert counter.get_total_flops() == 7 and seen == [torch.Tensor]  # not shape-wrapped


# -- DTensor and meshes --------------------------------------------------------------------------


def test_local_tensor_is_the_shard_object(mesh):
    dt = distribute_tensor(torch.arange(4.0), mesh["a"], [Shard(0)])
    assert compat.local_tensor(dt) is dt._local_tensor
    param = nn.Parameter(dt)
    assert param.to_local() is not param._local_tensor  # a view with grad on, for a Parameter
    assert compat.local_tensor(param) is param._local_tensor
    plain = torch.ones(1)
    assert compat.local_tensor(plain) is plain


def test_shard_shape_and_offset_rng_and_meshes(mesh):
    assert compat.compute_local_shape_and_global_offset((4, 2), mesh["a"], [Shard(0)]) == ((4, 2), (0, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert isinstance(compat.is_rng_supported_mesh(mesh), bool)
    flat = compat.flatten_mesh(mesh[("a", "b")], "ab")
    assert flat.mesh_dim_names == ("ab",) and flat.size() == 1
    split = compat.unflatten_mesh(flat, 0, (1, 1), ("x", "y"))
    assert split.mesh_dim_names == ("x", "y") and split["y"].size() == 1


def test_placement_pieces_are_every_ranks_piece_as_torch_splits_it():
    rows = torch.arange(10).view(10, 1)
    assert [p.view(-1).tolist() for p in compat.placement_pieces(Shard(0), torch.arange(5).view(5, 1), 4)] == [
        [0, 1], [2, 3], [4], []]  # torch.chunk's, the empty piece included
    assert [p.view(-1).tolist() for p in compat.placement_pieces(Shard(1), torch.arange(5).view(1, 5), 2)] == [
        [0, 1, 2], [3, 4]]
    strided = compat.strided_shard_type()(0, split_factor=2)  # split over tp (2) first, then over this dimension
    assert [p.view(-1).tolist() for p in compat.placement_pieces(strided, rows, 2)] == [[0, 1, 2, 5, 6, 7], [3, 4, 8, 9]]


def test_placement_pieces_without_the_split_fails_loudly(monkeypatch):
    from torch.distributed.tensor.placement_types import Shard as ShardClass

    monkeypatch.delattr(ShardClass, "_split_tensor")
    with gone("Shard._split_tensor"):
        compat.placement_pieces(Shard(0), torch.arange(4).view(4, 1), 2)
    with gone("Shard._split_tensor"):
        compat.check()


def test_funcol_and_foreach_mul():
    assert callable(compat.funcol().all_to_all_single)
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([[3.0]], dtype=torch.float32)
    compat.foreach_mul_([a, b], torch.tensor(0.5))
    assert a.tolist() == [0.5, 1.0] and b.tolist() == [[1.5]]


# -- nn.Module and optimizer internals -----------------------------------------------------------


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(2, 2)
        self.blocks = nn.ModuleDict({"0": nn.Linear(2, 2), "1": nn.Linear(2, 2)})
        self.register_module("last", None)
        self.register_buffer("kept", torch.ones(1))
        self.register_buffer("scratch", torch.zeros(1), persistent=False)
        self.scale = nn.Parameter(torch.ones(1))
        self.flag = "plain attribute"


def test_child_slots_and_module_view():
    net = _Net()
    assert list(compat.child_slots(net)) == ["first", "blocks", "last"]  # the None slot included
    blocks = compat.module_view(net.blocks, {"1": net.blocks["1"]}, share=False)
    assert type(blocks) is nn.ModuleDict and list(blocks.keys()) == ["1"] and blocks["1"] is net.blocks["1"]
    view = compat.module_view(net, {"blocks": blocks, "first": None})
    assert type(view) is _Net and view.flag == "plain attribute"
    assert view.first is None and view.blocks is blocks and net.first is not None
    assert view.scale is net.scale and view.kept is net.kept
    assert set(view.state_dict()) == {"scale", "kept", "blocks.1.weight", "blocks.1.bias"}  # scratch: not persistent
    view.register_forward_hook(lambda *a: None)
    assert not net._forward_hooks  # hooks of its own


def test_torch_nn_reset_parameters():
    mha = nn.MultiheadAttention(4, 1)
    assert compat.torch_nn_reset_parameters(mha) == mha._reset_parameters
    assert compat.torch_nn_reset_parameters(nn.Linear(2, 2)) is None

    class Foreign(nn.Module):
        def _reset_parameters(self):
            pass

    assert compat.torch_nn_reset_parameters(Foreign()) is None


def test_init_optimizer_hooks_gives_the_dicts_optimizer_reads():
    from lightning_disttrain.optim import HybridOptimizer

    p = nn.Parameter(torch.ones(2))
    opt = HybridOptimizer([torch.optim.SGD([p], lr=0.1)])
    for name in compat.OPTIMIZER_HOOK_DICTS:
        assert getattr(opt, name) == {}
    # torch's step wrapper (what Optimizer.__init__ patches a class's step with) reads the dicts
    assert torch.optim.Optimizer.profile_hook_step(lambda self: "stepped")(opt) == "stepped"


def test_parallel_style_base_delegates_apply(mesh):
    from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

    from lightning_disttrain.parallel.tensor import ReplicateOnShardedInput

    assert issubclass(ReplicateOnShardedInput, ParallelStyle)
    assert "_apply" not in vars(ReplicateOnShardedInput)  # it overrides no private
    norm = parallelize_module(nn.RMSNorm(4), mesh["b"], ReplicateOnShardedInput(dim=0))
    assert isinstance(norm.weight, DTensor) and norm.weight.placements == (Replicate(),)
    out = norm(torch.ones(2, 4))
    assert type(out) is torch.Tensor and out.shape == (2, 4)


# -- FSDP2 -------------------------------------------------------------------------------------


def _sharded(mesh):
    from torch.distributed.fsdp import fully_shard

    model = nn.Linear(4, 4)
    fully_shard(model, mesh=mesh["a"])
    return model


def test_fsdp_post_backward_accumulates_without_sync(mesh):
    # What a pipeline stage does inside a gradient-accumulation window: backward with sync off,
    # then FSDP's post-backward by hand (the unsharded gradient is kept); the window's last
    # backward, with sync on, reduces both.
    model = _sharded(mesh)
    x = torch.ones(3, 4)
    model.set_is_last_backward(False)
    model.set_reshard_after_backward(False)
    model.set_requires_gradient_sync(False)
    model(x).sum().backward()
    model.set_is_last_backward(True)
    model.set_reshard_after_backward(True)
    compat.fsdp_post_backward(model)
    assert model.weight.grad is None  # nothing reduced yet
    model.set_requires_gradient_sync(True)
    model(x).sum().backward()
    assert torch.equal(model.weight.grad.full_tensor(), torch.full((4, 4), 6.0))
    assert torch.equal(model.bias.grad.full_tensor(), torch.full((4,), 6.0))


def test_fsdp_post_backward_without_its_private_fails_loudly(mesh, monkeypatch):
    from torch.distributed.fsdp import fully_shard

    model = _sharded(mesh)
    monkeypatch.delattr(fully_shard.state(model), "_state_ctx")
    with gone("FSDPState._state_ctx"):
        compat.fsdp_post_backward(model)


# -- DCP ---------------------------------------------------------------------------------------


def test_dcp_single_process_load_and_storage_classes(tmp_path):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.save({"a": torch.arange(3.0), "b": {"c": torch.ones(2)}}, checkpoint_id=tmp_path, no_dist=True)
    state: dict = {}
    compat.load_state_dict_no_dist(state, dcp.FileSystemReader(tmp_path),
                                   compat.empty_state_dict_load_planner(keys={"a"}))
    assert list(state) == ["a"] and state["a"].tolist() == [0.0, 1.0, 2.0]
    assert str(compat.metadata_path(dcp.FileSystemReader(tmp_path))).endswith(".metadata")
    assert compat.fsspec_reader_class().__name__ == "FsspecReader"
    assert compat.fsspec_writer_class().__name__ == "FsspecWriter"


# -- compile -----------------------------------------------------------------------------------


def test_compilation_metrics_and_micro_pipeline_tp(monkeypatch):
    import torch._inductor.config as inductor_config

    assert isinstance(compat.compilation_metrics(), list)
    # The config module's own patch() restores it: pytest >= 9.2's monkeypatch.setattr records no
    # old value for a config default (it is not in the module's __dict__) and its undo *deletes*
    # it, which hid the option from every later test.
    with inductor_config.patch(_micro_pipeline_tp=False):
        compat.enable_micro_pipeline_tp()
        assert inductor_config._micro_pipeline_tp is True
    assert inductor_config._micro_pipeline_tp is False


@pytest.mark.parametrize("version, called", [("2.12.1", True), ("2.13.0", False), ("2.14.0", False)])
def test_symm_mem_is_enabled_below_2_13_only(monkeypatch, version, called):
    import torch.distributed._symmetric_memory as symm_mem

    calls = []
    monkeypatch.setattr(symm_mem, "enable_symm_mem_for_group", calls.append)
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(compat, "_WARNED", {version})  # the unchecked-version warning is tested above
    assert compat.enable_symm_mem_for_group("tp_group") is called
    assert calls == (["tp_group"] if called else [])


def test_symm_mem_gone_below_2_13_fails_loudly(monkeypatch):
    import torch.distributed._symmetric_memory as symm_mem

    monkeypatch.delattr(symm_mem, "enable_symm_mem_for_group")
    assert compat.enable_symm_mem_for_group("tp_group") is False  # 2.13: not needed, not looked up
    monkeypatch.setattr(torch, "__version__", "2.12.1")
    monkeypatch.setattr(compat, "_WARNED", {"2.12.1"})
    with pytest.raises(compat.TorchCompatError, match=r"enable_symm_mem_for_group.*installed torch 2\.12\.1"):
        compat.enable_symm_mem_for_group("tp_group")


def test_checkpoints_with_cache():
    class Marked(nn.Module):
        _can_checkpoint_with_cache = True

    assert compat.checkpoints_with_cache(Marked()) and not compat.checkpoints_with_cache(nn.Linear(1, 1))


# -- a private that is gone fails loudly ---------------------------------------------------------


def _module(name):
    import importlib

    return importlib.import_module(name)


MISSING = [
    # (private named in the error, (module or class to delete it from, attribute), the accessor call)
    ("torch.utils._pytree.tree_leaves", ("torch.utils._pytree", "tree_leaves"), lambda: compat.tree_leaves([1])),
    ("TorchDispatchMode", ("torch.utils._python_dispatch", "TorchDispatchMode"),
     lambda: compat.TorchDispatchMode),
    ("torch._C._current_graph_task_id", ("torch._C", "_current_graph_task_id"), compat.current_graph_task_id),
    ("compute_local_shape_and_global_offset",
     ("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset"),
     lambda: compat.compute_local_shape_and_global_offset((1,), None, [])),
    ("is_rng_supported_mesh", ("torch.distributed.tensor._random", "is_rng_supported_mesh"),
     lambda: compat.is_rng_supported_mesh(None)),
    ("_StridedShard", ("torch.distributed.tensor.placement_types", "_StridedShard"), compat.strided_shard_type),
    ("torch._foreach_mul_", ("torch", "_foreach_mul_"), lambda: compat.foreach_mul_([], torch.tensor(1.0))),
    ("_functional_collectives.wait_tensor", ("torch.distributed._functional_collectives", "wait_tensor"),
     compat.funcol),
    ("FsspecReader", ("torch.distributed.checkpoint._fsspec_filesystem", "FsspecReader"),
     compat.fsspec_reader_class),
    ("FsspecWriter", ("torch.distributed.checkpoint._fsspec_filesystem", "FsspecWriter"),
     compat.fsspec_writer_class),
    ("_EmptyStateDictLoadPlanner", ("torch.distributed.checkpoint.default_planner", "_EmptyStateDictLoadPlanner"),
     compat.empty_state_dict_load_planner),
    ("state_dict_loader._load_state_dict", ("torch.distributed.checkpoint.state_dict_loader", "_load_state_dict"),
     lambda: compat.load_state_dict_no_dist({}, None, None)),
    ("get_compilation_metrics", ("torch._dynamo.utils", "get_compilation_metrics"), compat.compilation_metrics),
    ("_PipelineScheduleRuntime", ("torch.distributed.pipelining.schedules", "_PipelineScheduleRuntime"),
     lambda: compat.compute_only_schedule([], {}, {})),
    ("schedules._Action", ("torch.distributed.pipelining.schedules", "_Action"),
     lambda: compat.compute_only_schedule([], {}, {})),
]


@pytest.mark.parametrize("private, where, call", MISSING, ids=[m[0] for m in MISSING])
def test_a_missing_private_raises_instead_of_falling_back(monkeypatch, private, where, call):
    module, attr = where
    monkeypatch.delattr(_module(module), attr)
    with gone(private):
        call()


def test_missing_attributes_of_objects_raise(monkeypatch, mesh):
    op = torch.ops.aten.add_.Tensor
    monkeypatch.delattr(op, "_schema")
    with gone("OpOverload._schema"):
        compat.op_schema(op)

    dt = distribute_tensor(torch.ones(2), mesh["a"], [Shard(0)])
    monkeypatch.delattr(DTensor, "_local_tensor")
    with gone("DTensor._local_tensor"):
        compat.local_tensor(dt)

    monkeypatch.delattr(DeviceMesh, "_flatten")
    monkeypatch.delattr(DeviceMesh, "_unflatten")
    with gone("DeviceMesh._flatten"):
        compat.flatten_mesh(mesh, "ab")
    with gone("DeviceMesh._unflatten"):
        compat.unflatten_mesh(mesh, 0, (1,), ("x",))

    from torch.distributed.checkpoint import FileSystemReader

    monkeypatch.delattr(FileSystemReader, "_get_metadata_path")
    with gone("FileSystemReader._get_metadata_path"):
        compat.metadata_path(FileSystemReader("/nonexistent"))


def test_module_internals_gone_raise():
    net = _Net()
    del net._modules  # nn.Module without its child slots
    with gone("torch.nn.Module._modules"):
        compat.child_slots(net)


def test_mha_private_reset_gone_fails_the_check(monkeypatch):
    monkeypatch.delattr(nn.MultiheadAttention, "_reset_parameters")
    with gone("MultiheadAttention._reset_parameters"):
        compat.check()


def test_a_new_optimizer_hook_dict_fails_loudly(monkeypatch):
    original = torch.optim.Optimizer.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self._optimizer_zero_grad_pre_hooks = OrderedDict()  # what a future torch might add

    monkeypatch.setattr(torch.optim.Optimizer, "__init__", init)
    with gone("_optimizer_*_hooks"):
        compat.init_optimizer_hooks(object.__new__(torch.optim.SGD))


def test_flop_counter_no_longer_reading_the_mark_fails_loudly(monkeypatch):
    from torch.utils.flop_counter import FlopCounterMode

    original = FlopCounterMode.__init__

    def init(self, *args, **kwargs):  # a torch whose FlopCounterMode does not read _get_raw
        original(self, *args, **kwargs)

    monkeypatch.setattr(FlopCounterMode, "__init__", init)
    monkeypatch.setattr(compat, "_FLOP_RAW_CHECKED", set())
    with gone("FlopCounterMode._get_raw"):
        compat.pass_flop_formula_through(lambda *a, **k: 0)


def test_parallel_style_without_apply_fails_loudly(monkeypatch):
    from torch.distributed.tensor.parallel import ParallelStyle

    monkeypatch.setattr(compat, "_STYLE_BASE", [])  # build the base class again
    monkeypatch.delattr(ParallelStyle, "_apply")
    with gone("ParallelStyle._apply"):
        compat.parallel_style_base()


def test_micro_pipeline_tp_gone_fails_loudly(monkeypatch):
    import torch._inductor.config as inductor_config

    # Hidden inside the config module's patch(), which brings it back: a config default is served
    # by the module's __getattr__, so monkeypatch.delattr (no __dict__ entry) refused it when no
    # earlier test had set it, and restored nothing when one had.
    with inductor_config.patch(_micro_pipeline_tp=False):
        delattr(inductor_config, "_micro_pipeline_tp")
        with gone("torch._inductor.config._micro_pipeline_tp"):
            compat.enable_micro_pipeline_tp()
        assert not hasattr(inductor_config, "_micro_pipeline_tp")  # not set after all
    assert inductor_config._micro_pipeline_tp is False

import pytest
import torch

from lightning_disttrain.models import GPT, GPTConfig
from lightning_disttrain.optim import HybridOptimizer, build_optimizer, build_scheduler, lr_multiplier


def _model():
    return GPT(GPTConfig.from_name("tiny", vocab_size=257, tie_embeddings=False))


def test_warmup_then_cosine_to_min_ratio():
    kw = dict(schedule="cosine", warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert lr_multiplier(0, **kw) == pytest.approx(0.1)
    assert lr_multiplier(9, **kw) == pytest.approx(1.0)
    assert lr_multiplier(60, **kw) == pytest.approx(0.55)
    assert lr_multiplier(110, **kw) == pytest.approx(0.1)
    values = [lr_multiplier(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_warmup_stable_decay():
    kw = dict(schedule="wsd", warmup_steps=5, total_steps=100, min_lr_ratio=0.0, decay_fraction=0.2)
    assert lr_multiplier(4, **kw) == 1.0
    assert lr_multiplier(50, **kw) == 1.0 and lr_multiplier(79, **kw) == 1.0
    assert lr_multiplier(90, **kw) == pytest.approx(0.5)
    assert lr_multiplier(100, **kw) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="unknown schedule"):
        lr_multiplier(0, schedule="step", warmup_steps=0, total_steps=1)


def test_adamw_decays_only_2d_weights():
    model = _model()
    opt = build_optimizer(model, "adamw", weight_decay=0.1)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"])
    assert all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_muon_hybrid_split_and_state_round_trip():
    model = _model()
    opt = build_optimizer(model, "muon", lr=1e-3, muon_lr=0.02)
    assert isinstance(opt, HybridOptimizer)
    muon, adamw = opt.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    muon_ids = {id(p) for g in muon.param_groups for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in muon_ids}
    assert names and all(n.startswith("blocks.") and model.get_parameter(n).dim() == 2 for n in names)
    for n in ("wte.weight", "lm_head.weight", "ln_f.weight", "blocks.0.attn.wq.bias"):
        assert n not in names
    sched = build_scheduler(opt, schedule="cosine", warmup_steps=2, total_steps=10)
    x = torch.randint(0, 257, (2, 16))
    for _ in range(3):
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    # Each group keeps its own base LR under the one scheduler.
    mult = lr_multiplier(3, schedule="cosine", warmup_steps=2, total_steps=10)
    assert muon.param_groups[0]["lr"] == pytest.approx(0.02 * mult)
    assert adamw.param_groups[0]["lr"] == pytest.approx(1e-3 * mult)
    state = opt.state_dict()
    fresh = build_optimizer(model, "muon", lr=1e-3, muon_lr=0.02)
    fresh.load_state_dict(state)
    for a, b in zip(fresh.optimizers, opt.optimizers):
        for pa, pb in zip(a.state.values(), b.state.values()):
            for k in pa:
                assert torch.equal(torch.as_tensor(pa[k]), torch.as_tensor(pb[k]))


def test_unknown_optimizer():
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'"):
        build_optimizer(_model(), "sgd")


def test_hybrid_optimizer_takes_step_and_state_dict_hooks():
    # Its hook dicts are the OrderedDicts torch's Optimizer makes: registering a hook used to fail
    # with "cannot create weak reference to 'dict'" (register_* keeps a weak reference to the dict).
    import torch

    from lightning_disttrain.optim import HybridOptimizer

    p = torch.nn.Parameter(torch.ones(2))
    opt = HybridOptimizer([torch.optim.SGD([p], lr=0.5)])
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
    p.grad = torch.ones(2)
    opt.step()
    assert calls == ["pre", "post"] and p.tolist() == [0.5, 0.5]
    with pytest.raises(NotImplementedError, match="register state_dict hooks on the parts"):
        opt.register_state_dict_post_hook(lambda o, sd: None)

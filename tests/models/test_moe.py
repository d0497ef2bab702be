"""The mixture-of-experts feed-forward (models/moe.py), its GPT integration and its training hooks.

Every numerical check compares against a naive reference written here: a loop over tokens and
their chosen experts, using the layer's parameters, so a wrong sort, gather, weight or scatter in
the layer shows up as a difference.
"""

import csv
import math

import lightning as L
import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_disttrain import GPTModule
from lightning_disttrain.models.gpt import GPT, MLP, GPTConfig
from lightning_disttrain.models.moe import (
    MoE,
    MoEConfig,
    grouped_mm_supported,
    moe_layers,
    sort_by_expert,
    update_moe_biases,
)

D, H, E = 16, 32, 4


def make_moe(seed=0, dtype=torch.float32, **kw) -> MoE:
    torch.manual_seed(seed)
    kw = {"dim": D, "hidden": H, "num_experts": E, "top_k": 2, **kw}
    moe = MoE(MoEConfig(**kw))
    moe.init_weights(std=0.3, resid_std=0.3)
    torch.nn.init.normal_(moe.router.weight, std=1.0)  # spread routing
    for p in moe.shared.parameters() if moe.shared is not None else ():
        torch.nn.init.normal_(p, std=0.3)
    return moe.to(dtype)


def _act(kind, h, g):
    if kind == "gelu":
        return F.gelu(h, approximate="tanh")
    if kind == "relu2":
        return F.relu(h) ** 2
    return F.silu(h) * g


def reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: score, pick the top-k by score + bias, sum weight · expert(x)."""
    c, ex = moe.config, moe.experts
    rows = []
    for xt in x.reshape(-1, c.dim):
        logits = moe.router.weight.float() @ xt.float()
        scores = logits.softmax(-1) if c.score == "softmax" else logits.sigmoid()
        biased = (scores + moe.expert_bias).tolist()
        chosen = sorted(range(c.num_experts), key=lambda e: -biased[e])[: c.top_k]
        w = scores[chosen]
        if c.score == "sigmoid":
            w = w / w.sum()
        y = torch.zeros_like(xt)
        for j, e in enumerate(chosen):
            g = ex.w3[e] @ xt if ex.w3 is not None else None
            y = y + w[j] * (ex.w2[e] @ _act(c.activation, ex.w1[e] @ xt, g))
        if moe.shared is not None:
            s = moe.shared
            g = s.w3.weight @ xt if s.w3 is not None else None
            y = y + s.w2.weight @ _act(c.activation, s.w1.weight @ xt, g)
        rows.append(y)
    return torch.stack(rows).view(x.shape)


def _grads(moe, fn, x, g):
    x = x.clone().requires_grad_()
    out = fn(x)
    params = [p for p in moe.parameters()]
    grads = torch.autograd.grad((out * g).sum(), [x, *params], allow_unused=True)
    return out.detach(), [torch.zeros_like(t) if d is None else d for t, d in zip([x, *params], grads)]


def _max_diff(a, b):
    """Largest difference of tensor pairs, relative to each reference's largest entry (at least 1):
    fp32 gradients summed in another order differ by ~1e-7 of their scale, which reaches 1e-5
    absolute on a weight gradient of magnitude 50 (seen on an AMD EPYC host)."""
    return max((u - v).abs().max().item() / max(1.0, v.abs().max().item()) for u, v in zip(a, b))


@pytest.mark.parametrize(("activation", "score", "shared"),
                         [("swiglu", "softmax", 0), ("swiglu", "sigmoid", 1), ("gelu", "softmax", 2),
                          ("relu2", "sigmoid", 0)])
def test_forward_and_backward_equal_the_per_token_reference(activation, score, shared):
    moe = make_moe(activation=activation, score=score, shared_experts=shared)
    moe.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))  # the bias changes the choice only
    x, g = torch.randn(2, 6, D), torch.randn(2, 6, D)
    out, grads = _grads(moe, moe, x, g)
    ref_out, ref_grads = _grads(moe, lambda t: reference(moe, t), x, g)
    assert (out - ref_out).abs().max().item() < 1e-5
    assert _max_diff(grads, ref_grads) < 1e-5
    assert all(gr.abs().sum() > 0 for gr in grads)  # every parameter (and x) got a gradient


def test_dropless_routes_every_token_to_k_distinct_experts():
    moe = make_moe(top_k=3)
    x = torch.randn(4, 5, D)
    idx, weights, _, _ = moe.route(x.reshape(-1, D))
    assert all(len(set(row)) == 3 for row in idx.tolist())
    moe(x)
    assert moe.last_load.sum().item() == 4 * 5 * 3 and moe.dropped_tokens is None
    order, counts, routed = sort_by_expert(idx, E)
    assert sorted(order.tolist()) == list(range(4 * 5 * 3)) and torch.equal(counts, routed)
    assert torch.equal(idx.reshape(-1)[order], torch.sort(idx.reshape(-1)).values)  # grouped by expert


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="this torch has no F.grouped_mm")
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_grouped_gemm_and_loop_agree(activation):
    moe = make_moe(activation=activation, shared_experts=1)
    x, g = torch.randn(3, 7, D), torch.randn(3, 7, D)
    assert grouped_mm_supported(x, moe.experts.w1, moe.experts.w2)
    moe.experts.use_grouped_mm = True
    out_g, grads_g = _grads(moe, moe, x, g)
    moe.experts.use_grouped_mm = False
    out_l, grads_l = _grads(moe, moe, x, g)
    assert (out_g - out_l).abs().max().item() < 1e-5 and _max_diff(grads_g, grads_l) < 1e-5
    # An expert that gets no token (empty group) in both paths.
    moe.expert_bias.copy_(torch.tensor([-10.0, 0.0, 0.0, 0.0]))
    moe.experts.use_grouped_mm = True
    out_g, grads_g = _grads(moe, moe, x, g)
    assert moe.last_load[0] == 0
    moe.experts.use_grouped_mm = False
    out_l, grads_l = _grads(moe, moe, x, g)
    assert (out_g - out_l).abs().max().item() < 1e-5 and _max_diff(grads_g, grads_l) < 1e-5


def test_unsupported_dtype_falls_back_to_the_loop():
    moe = make_moe()
    x = torch.randn(2, 5, D)
    out32 = moe(x)
    moe64 = make_moe(dtype=torch.float64)
    assert not grouped_mm_supported(x.double(), moe64.experts.w1)
    assert (moe64(x.double()).float() - out32).abs().max() < 1e-5
    assert not grouped_mm_supported(torch.randn(4, 6), torch.randn(2, 3, 6))  # 24-byte rows: unaligned


def _skewed_moe(speed):
    """Expert 0 scores highest for every token: a router the bias has to correct."""
    moe = make_moe(top_k=1, bias_update_speed=speed)
    u = torch.randn(D)
    with torch.no_grad():
        moe.router.weight.mul_(0.5)
        moe.router.weight[0] += 3 * u / u.norm()
    x = torch.randn(8, 16, D) * 0.5 + u / u.norm()
    return moe, x


def test_bias_update_moves_load_toward_balance_and_leaves_weights_alone():
    moe, x = _skewed_moe(speed=0.02)
    moe.train()
    ratios = []
    for _ in range(40):
        moe(x)
        moe.update_bias()
        ratios.append(moe.metrics()["max_load_ratio"].item())
    assert ratios[0] > 3.0  # almost all tokens on expert 0 (ratio 4 = all of them)
    # sign steps of a fixed size end in a small oscillation around balance (measured: 1.34 / 1.53)
    assert max(ratios[-10:]) < 1.6
    assert moe.expert_bias[0] < 0 and moe.expert_bias[1:].gt(moe.expert_bias[0]).all()
    # The combine weights are the raw scores of the chosen experts: no bias in them.
    moe.eval()  # eval forwards do not count toward the next update
    flat = x.reshape(-1, D)
    idx, weights, _, _ = moe.route(flat)
    assert not torch.equal(idx, (flat @ moe.router.weight.T).topk(1).indices)  # the bias did change the choice
    assert torch.allclose(weights, (flat @ moe.router.weight.T).softmax(-1).gather(-1, idx), atol=1e-7)
    assert (moe(x) - reference(moe, x)).abs().max() < 1e-5
    before = moe.expert_bias.clone()
    moe.update_bias()
    assert torch.equal(moe.expert_bias, before)


def test_bias_update_sums_the_micro_batches_of_a_step():
    moe, x = _skewed_moe(speed=0.01)
    moe.train()
    moe(x[:4])
    moe(x[4:])
    update_moe_biases([moe])
    assert moe.step_load.sum().item() == 8 * 16  # both micro-batches, top-1
    expected = 0.01 * torch.sign(moe.step_load.mean() - moe.step_load)
    assert torch.allclose(moe.expert_bias, expected)


def test_capacity_drops_and_counts_assignments():
    moe = make_moe(top_k=1, capacity_factor=1.0)
    with torch.no_grad():  # every token to expert 0
        moe.router.weight.zero_()
        moe.router.weight[0] = 1.0
    x = torch.rand(1, 8, D) + 0.1
    out = moe(x)
    assert moe.capacity(8) == 2 and moe.dropped_tokens.item() == 6
    moe_free = make_moe(top_k=1)
    moe_free.load_state_dict(moe.state_dict())
    assert torch.allclose(out[0, :2], moe_free(x)[0, :2], atol=1e-6)  # the first two keep their expert
    assert torch.equal(out[0, 2:], torch.zeros(6, D))  # the rest dropped (the residual carries them)
    # Random routing: the drops are the assignments past each expert's capacity, in token order.
    moe = make_moe(top_k=2, capacity_factor=0.5)
    x = torch.randn(2, 10, D)
    moe(x)
    cap = math.ceil(0.5 * 20 * 2 / E)
    seen, dropped = [0] * E, 0
    for row in moe.route(x.reshape(-1, D))[0].tolist():
        for e in row:
            seen[e] += 1
            dropped += seen[e] > cap
    assert moe.dropped_tokens.item() == dropped > 0


def test_sigmoid_weights_are_renormalised():
    moe = make_moe(score="sigmoid", top_k=2)
    flat = torch.randn(10, D)
    idx, weights, scores, logits = moe.route(flat)
    assert torch.allclose(weights.sum(-1), torch.ones(10))
    raw = logits.sigmoid().gather(-1, idx)
    assert torch.allclose(weights, raw / raw.sum(-1, keepdim=True))


def test_aux_and_z_losses_against_hand_computed_values():
    moe = make_moe(score="sigmoid", aux_loss_coef=0.1, z_loss_coef=0.01)
    S, T, k = 2, 3, 2
    x = torch.randn(S, T, D)
    moe(x)
    logits = (x.reshape(-1, D) @ moe.router.weight.T).view(S, T, E)
    scores = logits.sigmoid()
    idx = moe.route(x.reshape(-1, D))[0].view(S, T, k).tolist()
    balance = 0.0
    for s in range(S):
        for i in range(E):
            f = E / (k * T) * sum(i in idx[s][t] for t in range(T))
            p = sum(scores[s, t, i] / scores[s, t].sum() for t in range(T)) / T
            balance += f * p / S
    z = sum(math.log(sum(math.exp(v) for v in logits[s, t].tolist())) ** 2 for s in range(S) for t in range(T)) / (S * T)
    assert moe.balance_loss.item() == pytest.approx(float(balance), rel=1e-5)
    assert moe.z_loss.item() == pytest.approx(z, rel=1e-5)
    assert moe.aux_loss.item() == pytest.approx(0.1 * float(balance) + 0.01 * z, rel=1e-5)
    moe.aux_loss.backward()
    assert moe.router.weight.grad.abs().sum() > 0
    m = moe.metrics()
    assert {"balance_loss", "z_loss", "bias_norm", "max_load_ratio", "tokens_per_expert"} <= set(m)
    off = make_moe()
    off(x)
    assert off.aux_loss is None and off.balance_loss is None and off.z_loss is None


def test_gpt_builds_moe_in_the_right_blocks():
    every = GPT(GPTConfig.from_name("tiny", moe_num_experts=4))
    assert sorted(moe_layers(every)) == [0, 1, 2, 3]
    cfg = GPTConfig.from_name("tiny", n_layer=7, moe_num_experts=4, moe_first_dense=2, moe_every=2)
    model = GPT(cfg)
    assert sorted(moe_layers(model)) == [2, 4, 6]
    assert [isinstance(b.mlp, MLP) for b in model.blocks] == [True, True, False, True, False, True, False]
    assert isinstance(model.blocks[4].mlp, MoE) and model.blocks[4].mlp.experts.w1.shape == (4, cfg.mlp_hidden, 128)
    idx = torch.randint(0, 100, (2, 8))
    assert model(idx).shape == (2, 8, cfg.padded_vocab_size) and model.moe_aux_loss is None
    with_loss = GPT(GPTConfig.from_name("tiny-moe", moe_aux_loss_coef=0.01, moe_z_loss_coef=1e-3))
    with_loss(idx)
    layers = moe_layers(with_loss)
    assert torch.allclose(with_loss.moe_aux_loss, sum(m.aux_loss for m in layers.values()))
    # The residual projections of the experts get the GPT-2 residual init; the bias starts at 0.
    w2 = layers[1].experts.w2
    assert w2.std().item() == pytest.approx(0.02 / math.sqrt(2 * 4), rel=0.1)
    assert GPT(GPTConfig.from_name("tiny")).moe_aux_loss is None and not moe_layers(GPT(GPTConfig.from_name("tiny")))


def test_meta_build_then_init_weights_equals_a_direct_build():
    cfg = GPTConfig.from_name("tiny-moe", vocab_size=100, moe_shared_experts=1)
    direct = GPT(cfg)
    torch.manual_seed(3)
    direct.init_weights()  # depends only on the RNG state at the call
    with torch.device("meta"):
        meta = GPT(cfg)
    meta.to_empty(device="cpu")
    moe_layers(meta)[1].expert_bias.fill_(7.0)  # to_empty leaves garbage: init_weights must reset it
    torch.manual_seed(3)
    meta.init_weights()
    a, b = direct.state_dict(), meta.state_dict()
    assert "blocks.1.mlp.expert_bias" in a and a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_flops_per_token_count_active_parameters():
    cfg = GPTConfig.from_name("tiny", vocab_size=100, n_layer=3, moe_num_experts=4, moe_top_k=2,
                              moe_hidden=64, moe_shared_experts=1, moe_first_dense=1, mlp="swiglu")
    model = GPT(cfg)
    C, V = 128, cfg.padded_vocab_size
    attn = 4 * (C * C + C) + 2 * 2 * C  # q, k, v, o with biases; two LayerNorms
    dense = 3 * C * cfg.mlp_hidden + 2 * cfg.mlp_hidden + C  # w1, w3 (biased), w2 (+bias)
    expert = 3 * C * 64
    moe_active = C * 4 + 2 * expert + 1 * expert  # router, top-2 routed, one shared
    moe_total = C * 4 + 4 * expert + expert
    head = V * C + 2 * C  # the head at padded size, ln_f
    active = 3 * attn + dense + 2 * moe_active + head
    assert model.num_params(embeddings=False, padding=True, active=True) == active
    assert model.num_params(embeddings=False, padding=True) == active + 2 * (moe_total - moe_active)
    T = 64
    assert model.flops_per_token(T) == 6 * active + 12 * 3 * 4 * 32 * T
    dense_model = GPT(GPTConfig.from_name("tiny"))
    assert dense_model.num_params(active=True) == dense_model.num_params()


def test_presets_state_their_counts():
    with torch.device("meta"):
        big = GPT(GPTConfig.from_name("gpt2-moe"))
    total, active = big.num_params(), big.num_params(active=True)
    assert sorted(moe_layers(big)) == list(range(12))
    assert (total, active) == (294_336_768, 124_467_456)  # as stated in gpt.py's PRESETS
    tiny = GPT(GPTConfig.from_name("tiny-moe"))
    assert sorted(moe_layers(tiny)) == [1, 2, 3]
    assert (tiny.num_params(), tiny.num_params(active=True)) == (7_651_840, 7_258_624)


def _moe_loaders(vocab=64, n=32, t=16, bs=4):
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    data = (start + torch.arange(t + 1)) % vocab
    return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=bs)


def test_gpt_module_trains_with_moe_and_logs_metrics(tmp_path):
    torch.manual_seed(0)
    module = GPTModule("tiny-moe", vocab_size=64, lr=3e-3, model_overrides={
        "n_layer": 2, "moe_aux_loss_coef": 0.01, "moe_z_loss_coef": 1e-3, "moe_capacity_factor": 2.0,
        "moe_bias_update_speed": 0.01})
    biases = []

    class Watch(L.Callback):  # the bias before each batch and at the end
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            biases.append(moe_layers(pl_module.model)[1].expert_bias.clone())

        def on_train_end(self, trainer, pl_module):
            biases.append(moe_layers(pl_module.model)[1].expert_bias.clone())

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, accumulate_grad_batches=2,
                        logger=CSVLogger(tmp_path, name="moe"), log_every_n_steps=1, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Watch()])
    trainer.fit(module, _moe_loaders())
    # Once per optimizer step: the bias changes after batches 2, 4, 6 and not after 1, 3, 5.
    changed = [not torch.equal(a, b) for a, b in zip(biases, biases[1:])]
    assert changed == [False, True, False, True, False, True]
    path = next(tmp_path.rglob("metrics.csv"))
    with open(path) as f:
        rows = list(csv.DictReader(f))
    columns = set(rows[0])
    for name in ("max_load_ratio", "bias_norm", "balance_loss", "z_loss", "dropped_tokens"):
        assert f"moe/layer1/{name}" in columns
        assert any(r[f"moe/layer1/{name}"] for r in rows)
    assert "moe/layer0/max_load_ratio" not in columns  # block 0 is dense in tiny-moe
    assert "train/moe_aux_loss" in columns


def test_moe_options_from_yaml(tmp_path):
    from lightning_disttrain.cli import DistTrainCLI

    cfg = tmp_path / "moe.yaml"
    cfg.write_text("""
trainer: {accelerator: cpu, devices: 1, logger: false, enable_checkpointing: false, enable_progress_bar: false}
model:
  class_path: lightning_disttrain.GPTModule
  init_args:
    config: tiny
    model_overrides: {moe_num_experts: 4, moe_top_k: 1, moe_score: sigmoid, moe_first_dense: 1, moe_every: 2,
                      moe_aux_loss_coef: 0.001}
data: {class_path: lightning.pytorch.demos.boring_classes.BoringDataModule}
""")
    cli = DistTrainCLI(args=["--config", str(cfg)], run=False)
    c = cli.model.config
    assert (c.moe_num_experts, c.moe_top_k, c.moe_score, c.moe_aux_loss_coef) == (4, 1, "sigmoid", 0.001)
    assert cli.model.hparams["config"]["moe_every"] == 2  # stored with checkpoints
    cli.model.configure_model()
    assert sorted(moe_layers(cli.model.model)) == [1, 3]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"top_k": 5}, "top_k=5 must be between 1 and MoEConfig.num_experts=4"),
    ({"top_k": 0}, "top_k=0"),
    ({"num_experts": 0, "top_k": 1}, "num_experts=0"),
    ({"score": "tanh"}, "score='tanh' is unknown"),
    ({"capacity_factor": 0.0}, "capacity_factor=0.0 must be > 0"),
    ({"capacity_factor": -1.0}, "capacity_factor"),
    ({"shared_experts": -1}, "shared_experts"),
    ({"z_loss_coef": -0.1}, "z_loss_coef"),
])
def test_bad_moe_config_is_a_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(**{"dim": D, "hidden": H, "num_experts": E, **kwargs})


@pytest.mark.parametrize(("overrides", "match"), [
    ({"moe_top_k": 3}, "GPTConfig.moe_top_k is set but moe_num_experts=0"),
    ({"moe_capacity_factor": 1.0}, "moe_capacity_factor is set but moe_num_experts=0"),
    ({"moe_num_experts": 4, "moe_top_k": 5}, "GPTConfig.moe_top_k=5 must be between 1 and GPTConfig.moe_num_experts"),
    ({"moe_num_experts": 4, "moe_score": "relu"}, "GPTConfig.moe_score='relu'"),
    ({"moe_num_experts": 4, "moe_capacity_factor": 0}, "GPTConfig.moe_capacity_factor=0"),
    ({"moe_num_experts": -1}, "GPTConfig.moe_num_experts=-1"),
    ({"moe_num_experts": 4, "moe_first_dense": 4}, "GPTConfig.moe_first_dense=4 leaves no MoE block"),
    ({"moe_num_experts": 4, "moe_every": 0}, "GPTConfig.moe_every=0"),
])
def test_bad_gpt_moe_fields_are_value_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig.from_name("tiny", **overrides)
    with pytest.raises(ValueError, match=match):  # the LightningCLI / YAML route
        GPTModule("tiny", model_overrides=overrides)


def test_float8_never_converts_the_router():
    from lightning_disttrain.parallel.float8 import Float8Options, convert_to_float8

    model = GPT(GPTConfig.from_name("tiny-moe", vocab_size=64))
    converted = convert_to_float8(model, Float8Options(), device="cpu")
    assert converted  # attention and the dense block's MLP are converted ...
    for i, layer in moe_layers(model).items():  # ... the routers and the grouped experts are not
        assert type(layer.router) is torch.nn.Linear and f"blocks.{i}.mlp.router" not in converted
        assert not any(name.startswith(f"blocks.{i}.mlp.experts") for name in converted)


def test_compiled_moe_block_equals_eager_without_graph_breaks_in_bf16():
    # Dropless routing keeps every shape static (T*k assignments; the per-expert counts are a
    # tensor that the grouped GEMM takes as offsets), so a bf16 block compiles as one graph.
    torch.manual_seed(0)
    cfg = GPTConfig.from_name("tiny-moe", vocab_size=64, n_layer=1, moe_first_dense=0, n_embd=64, n_head=2,
                              moe_hidden=64)
    block = GPT(cfg).blocks[0].to(torch.bfloat16)
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    explained = torch._dynamo.explain(block)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    compiled = torch.compile(block, backend="aot_eager")
    torch.testing.assert_close(compiled(x), block(x), rtol=0, atol=0)


def test_the_parallel_plan_exposes_the_moe_layers():
    module = GPTModule("tiny-moe", vocab_size=64)
    plan = module.parallel_plan()
    assert plan.moe_layers == list(moe_layers(module.model).values()) and len(plan.moe_layers) == 3
    assert GPTModule("tiny", vocab_size=64).parallel_plan().moe_layers == []

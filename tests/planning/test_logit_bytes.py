"""The planner's logits term against the memory the real loss (``GPTModule.loss_fn``) takes on CPU:
every allocation and free of c10's CPU allocator replayed in time order (``torch.profiler``),
forward and backward of the loss alone on a (B, T, padded vocabulary) logits tensor."""

import itertools

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from lightning_disttrain.module import GPTModule
from lightning_disttrain.planning import Cluster, Layout, ModelShape, Workload, memory_per_gpu
from lightning_disttrain.planning.memory import LOGIT_GRAD_BYTES, LOGIT_SAVED_BYTES

B, T, V = 4, 256, 1000  # the head's output is padded to 1024 columns, as GPT pads its vocabulary


def _loss_memory(dtype: torch.dtype) -> dict[str, float]:
    """Bytes per logit element (B * T * V): kept between forward and backward, the peaks of each."""
    module = GPTModule("tiny", vocab_size=V)
    torch.manual_seed(0)
    hidden = torch.randn(B, T, 64, requires_grad=True)
    head = torch.randn(1024, 64, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, V, (B, T))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("mark::forward"):
            # The head's matmul, as the model's last op, straight into the loss as training_step
            # passes it: no other reference to the logits, so the loss can drop them.
            loss = module.loss_fn(hidden.to(dtype) @ head.t(), targets)
        with record_function("mark::backward"):
            loss.backward()
    events = prof.profiler.kineto_results.events()
    mem = sorted((e.start_ns(), e.nbytes()) for e in events
                 if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    spans = {e.name(): (e.start_ns(), e.end_ns()) for e in events if e.name().startswith("mark::")}
    running = list(itertools.accumulate(n for _, n in mem))

    def window(name: str) -> tuple[int, int]:
        lo, hi = spans["mark::" + name]
        inside = [r for (t, _), r in zip(mem, running) if lo <= t <= hi]
        before = [r for (t, _), r in zip(mem, running) if t < lo]
        return max(inside), (before[-1] if before else 0)

    forward_peak, _ = window("forward")
    backward_peak, kept = window("backward")
    elements = B * T * V
    # The head's weight gradient and the hidden states' (both outside the logits) are not in the
    # figures that matter here: they are a few hundred KB against the 4-12 MB of logits.
    return {"kept": kept / elements, "forward_peak": forward_peak / elements, "backward_peak": backward_peak / elements}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_loss_takes_12_bytes_per_logit_at_its_backward(dtype):
    m = _loss_memory(dtype)
    # kept for backward: the fp32 log-softmax output (the logits themselves are freed)
    assert m["kept"] == pytest.approx(LOGIT_SAVED_BYTES, abs=0.5)
    # the backward's peak: that output and two fp32 gradients; the forward's end is never above it
    assert m["backward_peak"] == pytest.approx(LOGIT_SAVED_BYTES + LOGIT_GRAD_BYTES, abs=0.5)
    assert m["forward_peak"] <= LOGIT_SAVED_BYTES + LOGIT_GRAD_BYTES + 0.5
    if dtype == torch.bfloat16:
        # the fp32 copy and the log-softmax output, the 16-bit logits already dropped: 8 B, not
        # 10 (loss_fn holding them through the loss cost 2 B more on a GPU, docs/benchmarks.md 9.2)
        assert m["forward_peak"] == pytest.approx(8, abs=0.5)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_plans_logits_term_is_the_losss_peak(precision):
    shape = ModelShape("one-block", params=10_000_000, embedding_params=2_000_000, block_params=8_000_000,
                       expert_params=0, active_params=10_000_000, n_layer=1, n_embd=256, n_head=4, vocab=50_000,
                       tied=False, flops_per_token=6 * 10**7, seq_len=1024)
    m = memory_per_gpu(shape, Layout(dp_shard=1), Workload(1024, 4, micro_batch=4, precision=precision),
                       Cluster("H100 SXM", 1))
    assert m.logits == pytest.approx(4 * 1024 * 50_000 * 12)

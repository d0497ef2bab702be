"""Hugging Face interop on one process: import (logits equal transformers'), export (from_pretrained
gives our logits; ours -> HF -> ours is bitwise), GPT-2's tokenizer files, and the refusals."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_fixtures import (  # noqa: E402
    GPT2_LIKE,
    LLAMA_LIKE,
    VOCAB,
    hf_gpt2,
    hf_llama,
    hf_logits,
    our_gpt,
    our_logits,
    save,
    tokens,
)

from lightning_disttrain.models.gpt import GPT, GPTConfig  # noqa: E402
from lightning_disttrain.models.hf import gpt_from_hf, save_hf  # noqa: E402
from lightning_disttrain.module import GPTModule  # noqa: E402

transformers = pytest.importorskip("transformers")
TOL = 1e-5
SHARED_TIKTOKEN = Path("/work/shared/tiktoken")


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())


# ---- HF -> ours -------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_gpt2_imports_with_transformers_logits(tmp_path, tied):
    hf = hf_gpt2(tied=tied)
    ours = gpt_from_hf(save(hf, tmp_path / "hf"))
    c = ours.config
    assert (c.vocab_size, c.n_embd, c.n_layer, c.block_size, c.tie_embeddings) == (VOCAB, 64, 2, 32, tied)
    assert (c.pos_emb, c.norm, c.mlp, c.bias) == ("learned", "layernorm", "gelu", True)
    assert (c.dropout, c.norm_eps) == (0.1, 1e-5)
    assert (ours.lm_head.weight is ours.wte.weight) == tied
    idx = tokens()
    assert _max_diff(our_logits(ours, idx), hf_logits(hf, idx)) < TOL
    assert torch.count_nonzero(ours.wte.weight[VOCAB:]) == 0  # vocabulary padding rows start at zero


@pytest.mark.parametrize(("tied", "bias", "kv_heads"), [(False, False, 2), (True, True, 4)],
                         ids=["gqa-untied", "mha-tied-bias"])
def test_llama_imports_with_transformers_logits(tmp_path, tied, bias, kv_heads):
    hf = hf_llama(tied=tied, bias=bias, kv_heads=kv_heads)
    # sharded safetensors with an index, as large models are published
    path = save(hf, tmp_path / "hf", max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    ours = gpt_from_hf(path)
    c = ours.config
    assert (c.pos_emb, c.norm, c.mlp, c.n_kv_head, c.rope_theta, c.norm_eps) == ("rope", "rmsnorm", "swiglu",
                                                                                  kv_heads, 5000.0, 1e-6)
    assert (c.tie_embeddings, c.bias, c.mlp_hidden, c.block_size) == (tied, bias, 96, 32)
    idx = tokens()
    assert _max_diff(our_logits(ours, idx), hf_logits(hf, idx)) < TOL


def test_pytorch_model_bin_in_hub_layout_imports(tmp_path):
    # openai-community/gpt2's own files: names without "transformer.", the causal-mask buffers
    # (h.N.attn.bias) saved beside the weights, the tied head left out.
    hf = hf_gpt2()
    path = tmp_path / "hf"
    hf.config.save_pretrained(path)
    state = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    state.update({f"h.{i}.attn.bias": torch.ones(1, 1, 32, 32).tril() for i in range(2)})
    torch.save(state, path / "pytorch_model.bin")
    ours = gpt_from_hf(path)
    idx = tokens()
    assert _max_diff(our_logits(ours, idx), hf_logits(hf, idx)) < TOL


def test_gptmodule_init_from_yaml_and_on_the_meta_device(tmp_path):
    from lightning_disttrain.cli import DistTrainCLI
    from lightning_disttrain.parallel.materialize import materialize_

    hf = hf_llama()
    path = save(hf, tmp_path / "hf")
    idx = tokens()
    expected = hf_logits(hf, idx)
    config = {"trainer": {"accelerator": "cpu", "devices": 1, "logger": False},
              "model": {"class_path": "lightning_disttrain.GPTModule",
                        "init_args": {"init_from": str(path), "model_overrides": {"block_size": 16}}},
              "data": {"class_path": "hf_fixtures.NoData"}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    cli = DistTrainCLI(args=["--config", str(tmp_path / "run.yaml")], run=False)
    module = cli.model
    assert module.config == GPTConfig(**{**asdict(gpt_from_hf(path).config), "block_size": 16})
    assert module.hparams["config"] == asdict(module.config) and module.hparams["init_from"] == str(path)
    module.configure_model()
    assert _max_diff(our_logits(module.model, idx), expected) < TOL
    # Built on the meta device: the strategy materialises, then init_weights loads (and the
    # check that every tensor was written passes).
    meta = GPTModule(init_from=path, init_device="meta")
    meta.configure_model()
    assert meta.model.wte.weight.is_meta
    materialize_(meta, "cpu")
    assert _max_diff(our_logits(meta.model, idx), expected) < TOL


def test_gptmodule_init_from_refuses_another_architecture(tmp_path):
    path = save(hf_gpt2(), tmp_path / "hf")
    with pytest.raises(ValueError, match=r"n_layer=1 \(it has 2\).*only dropout, pad_vocab_multiple, block_size"):
        GPTModule(init_from=path, model_overrides={"n_layer": 1})
    with pytest.raises(ValueError, match=r"n_layer=12 \(it has 2\)"):
        GPTModule("gpt2-124m", init_from=path)
    with pytest.raises(ValueError, match=r"block_size=64 \(its position table has 32 rows\)"):
        GPTModule(init_from=path, model_overrides={"block_size": 64})
    # A checkpoint's stored config that is not the HF model's: refused when the weights load.
    module = GPTModule(asdict(GPTConfig(**GPT2_LIKE, n_kv_head=2)), init_from=path)
    with pytest.raises(ValueError, match=r"n_kv_head=2 \(it has 4\)"):
        module.configure_model()


# ---- ours -> HF -> ours ---------------------------------------------------------------------


@pytest.mark.parametrize("fields", [
    GPT2_LIKE, dict(GPT2_LIKE, tie_embeddings=False), LLAMA_LIKE, dict(LLAMA_LIKE, tie_embeddings=True, bias=True),
], ids=["gpt2", "gpt2-untied", "llama", "llama-tied-bias"])
def test_export_loads_in_transformers_and_round_trips_bitwise(tmp_path, fields):
    ours = our_gpt(**fields)
    out = save_hf(ours.config, ours.state_dict(), tmp_path / "hf")
    assert not (out / "vocab.json").exists()  # a 100-token vocabulary is not GPT-2's BPE
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    hf.eval()
    assert {k: v for k, v in info.items() if v and k != "error_msgs"} == {}, info  # nothing missing or unexpected
    assert type(hf).__name__ == ("LlamaForCausalLM" if fields.get("pos_emb") == "rope" else "GPT2LMHeadModel")
    head, emb = hf.get_output_embeddings().weight, hf.get_input_embeddings().weight
    assert (head.data_ptr() == emb.data_ptr()) == ours.config.tie_embeddings
    idx = tokens()
    assert _max_diff(hf_logits(hf, idx), our_logits(ours, idx)) < TOL

    back = gpt_from_hf(out)
    assert back.config == ours.config
    original, returned = ours.state_dict(), back.state_dict()
    assert original.keys() == returned.keys()
    for name, t in original.items():
        rows = VOCAB if name in ("wte.weight", "lm_head.weight") else None  # padding rows come back as zeros
        assert torch.equal(returned[name][:rows], t[:rows]), name
    assert torch.equal(our_logits(back, idx), our_logits(ours, idx))


def test_export_casts_dtype(tmp_path):
    ours = our_gpt(**LLAMA_LIKE)
    out = save_hf(ours.config, ours.state_dict(), tmp_path / "hf", dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    back = gpt_from_hf(out)
    assert back.wte.weight.dtype == torch.bfloat16
    assert torch.equal(back.blocks[0].attn.wq.weight, ours.blocks[0].attn.wq.weight.bfloat16())


def test_gpt2_vocabulary_exports_gpt2_tokenizer_files(tmp_path):
    from lightning_disttrain.data import get_tokenizer

    ours = our_gpt(n_layer=1, n_head=2, n_embd=16, block_size=16)  # vocab_size 50257
    out = save_hf(ours.config, ours.state_dict(), tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert (config["vocab_size"], config["eos_token_id"]) == (50257, 50256)
    vocab = json.loads((out / "vocab.json").read_text(encoding="utf-8"))
    merges = (out / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert len(vocab) == 50257 and vocab["<|endoftext|>"] == 50256 and len(merges) == 1 + 50000
    if SHARED_TIKTOKEN.is_dir():  # OpenAI's released encoder.json and vocab.bpe
        released = json.loads((SHARED_TIKTOKEN / "6c7ea1a7e38e3a7f062df639a5b80947f075ffe6").read_text("utf-8"))
        assert vocab == released
        bpe = (SHARED_TIKTOKEN / "6d1cbeee0f20b3d9449abfede4726ed8212e3aee").read_text("utf-8").splitlines()
        assert merges[1:] == [m for m in bpe[1:] if m]
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.encode("Hello world") == [15496, 995]
    text = "  The café's naïve coder wrote\tdef f(x):\n    return x**2  # 🙂 it's 1999"
    assert tok.encode(text) == get_tokenizer("gpt2").encode(text)
    assert tok.eos_token_id == 50256 and tok.encode("<|endoftext|>") == [50256]


@pytest.mark.parametrize(("fields", "refusal"), [(LLAMA_LIKE, None), (dict(GPT2_LIKE, qk_norm=True), "qk_norm=True")],
                         ids=["llama", "qk-norm-refused"])
def test_cli_exports_a_checkpoint_directory(tmp_path, capsys, fields, refusal):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from lightning_disttrain.checkpoint import CheckpointWriter
    from lightning_disttrain.cli import main

    ours = our_gpt(**fields)
    module = torch.nn.ModuleDict({"model": ours})  # a LightningModule's names: "model.*"
    ckpt = tmp_path / "step=1.ckpt"
    CheckpointWriter().save(ckpt, {"state_dict": get_model_state_dict(module)},
                            {"global_step": 1, "epoch": 0, "hyper_parameters": {"config": asdict(ours.config)}},
                            global_step=1, epoch=0)
    args = ["export", str(ckpt), str(tmp_path / "hf"), "--format", "hf"]
    if refusal:
        with pytest.raises(SystemExit, match=f"error: .*{refusal}"):
            main(args)
        return
    main(args)
    assert f"exported {str(ckpt.resolve())!r} (global step 1" in capsys.readouterr().out
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    idx = tokens()
    assert _max_diff(hf_logits(hf, idx), our_logits(ours, idx)) < TOL


# ---- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("fields", "match"), [
    (dict(GPT2_LIKE, qk_norm=True), r"qk_norm=True"),
    (dict(LLAMA_LIKE, mlp="relu2", mlp_hidden=None), r"mlp='relu2' \(needs 'swiglu'\)"),
    (dict(LLAMA_LIKE, norm="layernorm"), r"norm='layernorm' \(needs 'rmsnorm'\)"),
    (dict(GPT2_LIKE, n_kv_head=2), r"n_kv_head=2 \(needs 4\)"),
    (dict(GPT2_LIKE, bias=False), r"bias=False \(needs True\)"),
    (dict(GPT2_LIKE, norm="rmsnorm"), r"as GPT-2 \(learned positions\), but norm='rmsnorm'"),
    (dict(LLAMA_LIKE, moe_num_experts=4, moe_top_k=2), r"moe_num_experts=4 \(needs 0\)"),
])
def test_export_refuses_what_transformers_cannot_express(tmp_path, fields, match):
    ours = GPT(GPTConfig(**fields))
    with pytest.raises(ValueError, match=match):
        save_hf(ours.config, ours.state_dict(), tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_export_refuses_gpt2_tokenizer_files_for_another_vocabulary(tmp_path):
    ours = GPT(GPTConfig(**GPT2_LIKE))
    with pytest.raises(ValueError, match=r"tokenizer=True writes GPT-2's BPE \(50257 tokens\), but vocab_size=100"):
        save_hf(ours.config, ours.state_dict(), tmp_path / "hf", tokenizer=True)
    assert not (tmp_path / "hf").exists()


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _edit_tensors(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(("break_it", "match"), [
    (lambda p: _edit_tensors(p, lambda t: t.update({"transformer.h.0.attn.extra": torch.zeros(3)})),
     r"unknown: transformer\.h\.0\.attn\.extra"),
    (lambda p: _edit_tensors(p, lambda t: t.pop("transformer.h.1.ln_2.bias")),
     r"missing: transformer\.h\.1\.ln_2\.bias"),
    (lambda p: _edit_config(p, n_positions=64),
     r"mismatched shapes: transformer\.wpe\.weight \[32, 64\] \(expected \[64, 64\]\)"),
    (lambda p: _edit_config(p, n_inner=128),
     r"transformer\.h\.0\.mlp\.c_fc\.weight \[64, 256\] \(expected \[64, 128\]\)"),
    (lambda p: _edit_config(p, model_type="bert"), r"model_type='bert' cannot be imported"),
    (lambda p: _edit_config(p, activation_function="relu"), r"activation_function='relu'"),
    (lambda p: _edit_config(p, scale_attn_by_inverse_layer_idx=True), r"scale_attn_by_inverse_layer_idx=True"),
    (lambda p: (p / "model.safetensors").unlink(), r"holds no weights"),
    (lambda p: (p / "config.json").unlink(), r"no config\.json"),
])
def test_import_refuses_bad_checkpoints(tmp_path, break_it, match):
    path = save(hf_gpt2(), tmp_path / "hf")
    break_it(path)
    with pytest.raises(ValueError, match=match):
        gpt_from_hf(path)


def test_import_refuses_scaled_rope_and_odd_heads(tmp_path):
    path = save(hf_llama(), tmp_path / "hf")
    _edit_config(path, rope_parameters={"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0})
    with pytest.raises(ValueError, match=r"rope_parameters=.*only unscaled RoPE"):
        gpt_from_hf(path)
    _edit_config(path, rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, head_dim=32)
    with pytest.raises(ValueError, match=r"head_dim=32"):
        gpt_from_hf(path)

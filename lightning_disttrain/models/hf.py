"""Hugging Face interop: checkpoints in ``transformers``' layout to and from our ``GPT``.

Two architectures cover what ``GPTConfig`` can express:

- GPT-2 (``GPT2LMHeadModel``): learned positions, LayerNorm, GELU (tanh approximation, HF's
  ``gelu_new``), biases everywhere, plain multi-head attention; head tied or not.
- Llama (``LlamaForCausalLM``): RoPE (rotate-half layout, as ours), RMSNorm, SwiGLU, grouped-query
  attention, biases off or on (``attention_bias`` and ``mlp_bias`` together); head tied or not.

Anything else (QK-norm, ReLU², LayerNorm with RoPE, scaled RoPE, ...) is refused with a
``ValueError`` that names the field. Only ``safetensors`` is needed, not ``transformers``.

One table per architecture (``weight_map``) pairs each of our tensors with the rows of an HF tensor
it is: GPT-2's ``Conv1D`` stores weights as [in, out] (transposed against ``nn.Linear``) and fuses
q, k, v into one ``c_attn``; our embedding and untied head carry vocabulary padding rows, which
import fills with zeros and export drops. Import and export read the same table, so they cannot
drift apart, and import reads only the rows a rank holds: a model sharded on the meta device
loads each rank's shards straight from the safetensors file.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from lightning_disttrain import _torch_compat as torch_compat
from lightning_disttrain.models.gpt import GPT, GPTConfig, rope_tables
from lightning_disttrain.models.hf_config import (  # noqa: F401  (re-exported: the interop API is here)
    BIN,
    OVERRIDABLE,
    SAFETENSORS,
    check_compatible,
    config_from_hf,
    config_from_hf_dir,
    config_to_hf,
    hf_architecture,
    read_hf_config,
)

# Tensors older transformers versions saved that are derived, not learned: skipped on import.
_DERIVED = re.compile(r"(\.attn\.bias|\.attn\.masked_bias|\.rotary_emb\.inv_freq)$")


# ---- the weight table -----------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """Our tensor ``ours`` is rows ``start : start + rows`` of HF tensor ``hf`` (transposed first
    when ``transpose``: a ``Conv1D`` weight); rows of ours past ``rows`` are vocabulary padding."""

    ours: str
    hf: str
    rows: int
    cols: int | None = None  # None for vectors
    start: int = 0
    transpose: bool = False


def weight_map(config: GPTConfig) -> list[Entry]:
    """Every learned tensor of ``GPT(config)`` (tied head: once, as ``wte.weight``), with its HF source."""
    c = config
    E, KV, H, V = c.n_embd, c.n_kv_head * c.head_dim, c.mlp_hidden, c.vocab_size
    kind = hf_architecture(c)
    out: list[Entry] = []
    if kind == "gpt2":
        P = "transformer."
        out += [Entry("wte.weight", P + "wte.weight", V, E), Entry("wpe.weight", P + "wpe.weight", c.block_size, E)]
        for i in range(c.n_layer):
            o, h = f"blocks.{i}.", f"{P}h.{i}."
            for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
                out += [Entry(f"{o}{ours}.weight", f"{h}{theirs}.weight", E),
                        Entry(f"{o}{ours}.bias", f"{h}{theirs}.bias", E)]
            for j, name in enumerate(("wq", "wk", "wv")):  # c_attn is q, k, v side by side
                out += [Entry(f"{o}attn.{name}.weight", f"{h}attn.c_attn.weight", E, E, j * E, True),
                        Entry(f"{o}attn.{name}.bias", f"{h}attn.c_attn.bias", E, None, j * E)]
            for ours, theirs, n, k in (("attn.wo", "attn.c_proj", E, E), ("mlp.w1", "mlp.c_fc", H, E),
                                       ("mlp.w2", "mlp.c_proj", E, H)):
                out += [Entry(f"{o}{ours}.weight", f"{h}{theirs}.weight", n, k, transpose=True),
                        Entry(f"{o}{ours}.bias", f"{h}{theirs}.bias", n)]
        out += [Entry("ln_f.weight", P + "ln_f.weight", E), Entry("ln_f.bias", P + "ln_f.bias", E)]
    else:
        P = "model."
        out.append(Entry("wte.weight", P + "embed_tokens.weight", V, E))
        for i in range(c.n_layer):
            o, h = f"blocks.{i}.", f"{P}layers.{i}."
            out += [Entry(f"{o}attn_norm.weight", f"{h}input_layernorm.weight", E),
                    Entry(f"{o}mlp_norm.weight", f"{h}post_attention_layernorm.weight", E)]
            for ours, theirs, n, k in (("attn.wq", "self_attn.q_proj", E, E), ("attn.wk", "self_attn.k_proj", KV, E),
                                       ("attn.wv", "self_attn.v_proj", KV, E), ("attn.wo", "self_attn.o_proj", E, E),
                                       ("mlp.w1", "mlp.gate_proj", H, E), ("mlp.w3", "mlp.up_proj", H, E),
                                       ("mlp.w2", "mlp.down_proj", E, H)):
                out.append(Entry(f"{o}{ours}.weight", f"{h}{theirs}.weight", n, k))
                if c.bias:
                    out.append(Entry(f"{o}{ours}.bias", f"{h}{theirs}.bias", n))
        out.append(Entry("ln_f.weight", P + "norm.weight", E))
    if not c.tie_embeddings:
        out.append(Entry("lm_head.weight", "lm_head.weight", V, E))
    return out


def hf_shapes(entries: list[Entry]) -> dict[str, tuple[int, ...]]:
    """The shape of every HF tensor the entries come from, as transformers stores it."""
    rows: dict[str, int] = {}
    for e in entries:
        rows[e.hf] = max(rows.get(e.hf, 0), e.start + e.rows)
    shapes = {}
    for e in entries:
        shape = (rows[e.hf],) if e.cols is None else (rows[e.hf], e.cols)
        shapes[e.hf] = shape[::-1] if e.transpose else shape
    return shapes


# ---- import ---------------------------------------------------------------------------------


class HFWeights:
    """The tensors of a Hugging Face model directory (``model.safetensors``, ``pytorch_model.bin``,
    or either sharded with its ``.index.json``), under their canonical names (``transformer.`` /
    ``model.`` prefixed). safetensors reads only the slice asked for. Use as a context manager."""

    def __init__(self, path: str | os.PathLike, prefix: str) -> None:
        self.path, self._stack = Path(path), ExitStack()
        self._files: dict[str, object] = {}
        self._where: dict[str, tuple[str, str]] = {}  # canonical name -> (file, name in the file)
        for stem in (SAFETENSORS, BIN):
            index = self.path / f"{stem}.index.json"
            if index.is_file():
                mapping = json.loads(index.read_text())["weight_map"]
                break
            if (self.path / stem).is_file():
                mapping = None
                break
        else:
            raise ValueError(f"{str(self.path)!r} holds no weights: expected {SAFETENSORS} or {BIN} (or a sharded "
                             f"{SAFETENSORS}.index.json) beside config.json")
        files = sorted(set(mapping.values())) if mapping else [stem]
        for file in files:
            if not _plain_file_name(file):
                raise ValueError(f"{str(self.path / f'{stem}.index.json')!r} maps weights to {file!r}, which is not "
                                 f"a file name in that directory; a sharded checkpoint names its shards beside its "
                                 f"index (no directories, no '..')")
        for file in files:
            for name in self._open(file).keys():
                canonical = name if name.startswith(prefix) or name == "lm_head.weight" else prefix + name
                self._where[canonical] = (file, name)

    def _open(self, file: str):
        if file not in self._files:
            full = self.path / file
            if file.endswith(".safetensors"):
                from safetensors import safe_open

                self._files[file] = self._stack.enter_context(safe_open(str(full), framework="pt"))
            else:
                try:
                    self._files[file] = torch.load(full, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError:  # a legacy (non-zip) torch.save file cannot be memory-mapped
                    self._files[file] = torch.load(full, map_location="cpu", weights_only=True)
        return self._files[file]

    def names(self) -> set[str]:
        return set(self._where)

    def _get(self, name: str):
        file, key = self._where[name]
        handle = self._open(file)
        return handle.get_slice(key) if file.endswith(".safetensors") else handle[key]

    def shape(self, name: str) -> tuple[int, ...]:
        t = self._get(name)
        return tuple(t.get_shape()) if hasattr(t, "get_shape") else tuple(t.shape)

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self._get(name)[index]

    def __enter__(self) -> HFWeights:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._files.clear()


def _prefix(config: GPTConfig) -> str:
    return "transformer." if hf_architecture(config) == "gpt2" else "model."


def check_tensors(weights: HFWeights, config: GPTConfig) -> None:
    """Every tensor of ``config``'s architecture is in the files with its shape, and nothing else is."""
    expected = hf_shapes(weight_map(config))
    found = {n for n in weights.names() if not _DERIVED.search(n)}
    if config.tie_embeddings:
        found.discard("lm_head.weight")  # some saves include the tied head; transformers re-ties it
    problems = []
    if missing := sorted(set(expected) - found):
        problems.append(f"missing: {', '.join(missing)}")
    if unknown := sorted(found - set(expected)):
        problems.append(f"unknown: {', '.join(unknown)}")
    wrong = [f"{n} {list(weights.shape(n))} (expected {list(s)})" for n, s in expected.items()
             if n in found and weights.shape(n) != s]
    if wrong:
        problems.append(f"mismatched shapes: {', '.join(wrong)}")
    if problems:
        raise ValueError(f"the tensors in {str(weights.path)!r} do not match its config.json: {'; '.join(problems)}")


def _reader(weights: HFWeights, e: Entry) -> Callable[[tuple[int, ...], tuple[int, ...]], torch.Tensor]:
    """Reads the block (offset, shape) of our tensor ``e.ours`` from the HF tensor: the rows past
    ``e.rows`` (vocabulary padding) are zeros."""

    def read(offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        first, n = offset[0], shape[0]
        real = max(0, min(first + n, e.rows) - first)
        if real == 0:  # only padding rows in this block
            return torch.zeros(shape)
        rows = slice(e.start + first, e.start + first + real)
        cols = (slice(offset[1], offset[1] + shape[1]),) if e.cols is not None else ()
        part = weights.read(e.hf, (*cols, rows)).T if e.transpose else weights.read(e.hf, (rows, *cols))
        if real == n:
            return part
        return torch.cat([part, part.new_zeros((n - real, *shape[1:]))])

    return read


@torch.no_grad()
def _assign(target: torch.Tensor, read: Callable[[tuple[int, ...], tuple[int, ...]], torch.Tensor]) -> None:
    """Copy into ``target`` (a plain tensor or this rank's shard of a DTensor) what ``read`` gives."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    if not isinstance(target, DTensor):
        target.copy_(read((0,) * target.ndim, tuple(target.shape)))
        return
    local = target.to_local()
    if all(type(p) in (Shard, Replicate) for p in target.placements):
        shape, offset = torch_compat.compute_local_shape_and_global_offset(target.shape, target.device_mesh,
                                                                           target.placements)
        if local.numel():
            local.copy_(read(tuple(offset), tuple(shape)))
    else:  # e.g. FSDP over tensor parallel on one dim (_StridedShard): cut the full tensor locally
        full = read((0,) * target.ndim, tuple(target.shape))
        local.copy_(distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local())


def load_hf_weights_(model: GPT, path: str | os.PathLike) -> None:
    """Load a Hugging Face checkpoint into ``model`` in place, on any device, also when it is
    sharded (DTensor parameters: each rank reads only its shards) or a pipeline stage (only the
    tensors it holds). ``model.config`` must have the checkpoint's architecture (``check_compatible``);
    every parameter and buffer is written."""
    source = config_from_hf_dir(path)
    check_compatible(model.config, source, where=f"{str(path)!r}/config.json")
    entries = {e.ours: e for e in weight_map(model.config)}
    with HFWeights(path, _prefix(source)) as weights:
        check_tensors(weights, source)
        for name, tensor in model.named_parameters():
            _assign(tensor, _reader(weights, entries[name]))
    if model.config.pos_emb == "rope" and getattr(model, "rope_cos", None) is not None:
        cos, sin = rope_tables(model.config)
        _assign(model.rope_cos, lambda offset, shape: cos)
        _assign(model.rope_sin, lambda offset, shape: sin)


def gpt_from_hf(path: str | os.PathLike, **overrides) -> GPT:
    """The model in the Hugging Face directory ``path`` (``config.json`` and ``model.safetensors`` or
    ``pytorch_model.bin``, GPT-2 or Llama family), in eval mode with ``trim_logits`` set, in the
    checkpoint's floating-point dtype. ``overrides``: ``OVERRIDABLE`` GPTConfig fields."""
    unknown = set(overrides) - {f.name for f in fields(GPTConfig)}
    if unknown:
        raise ValueError(f"GPTConfig has no field(s) {sorted(unknown)}")
    config = GPTConfig(**{**asdict(config_from_hf_dir(path)), **overrides})
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device="cpu")  # every tensor is then written by the load: no random init first
    if config.tie_embeddings:
        model.lm_head.weight = model.wte.weight
    with HFWeights(path, _prefix(config)) as weights:
        dtypes = {weights.read(n, (slice(0, 1),)).dtype for n in weights.names() if not _DERIVED.search(n)}
    if len(dtypes) == 1 and (dtype := dtypes.pop()).is_floating_point:
        model.to(dtype)
    load_hf_weights_(model, path)
    model.trim_logits = True
    return model.eval()


# ---- export ---------------------------------------------------------------------------------


def hf_state_dict(config: GPTConfig, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict (``GPT`` names, vocabulary padded) as ``transformers`` names and layouts."""
    entries = weight_map(config)
    extra = set(state_dict) - {e.ours for e in entries} - ({"lm_head.weight"} if config.tie_embeddings else set())
    missing = {e.ours for e in entries} - set(state_dict)
    if extra or missing:
        raise ValueError(f"the state dict does not fit this GPTConfig: missing {sorted(missing)}, unknown "
                         f"{sorted(extra)}; pass the model's own state dict (GPT names, no 'model.' prefix)")
    by_hf: dict[str, list[Entry]] = {}
    for e in entries:
        by_hf.setdefault(e.hf, []).append(e)
    out = {}
    for name, group in by_hf.items():
        parts = [state_dict[e.ours].detach()[: e.rows] for e in sorted(group, key=lambda e: e.start)]
        t = torch.cat(parts) if len(parts) > 1 else parts[0]
        t = (t.T if group[0].transpose else t).contiguous().cpu()
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # a view of the padded table: safetensors writes whole tensors only
        out[name] = t
    return out


def save_hf(config: GPTConfig, state_dict: Mapping[str, torch.Tensor], out_dir: str | os.PathLike, *,
            dtype: torch.dtype | None = None, tokenizer: bool | None = None) -> Path:
    """Write ``out_dir/config.json`` + ``model.safetensors`` that ``transformers``'
    ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads (GPT-2 or Llama, see ``hf_architecture``).

    ``tokenizer``: also write GPT-2's BPE files (vocab.json, merges.txt, tokenizer_config.json); None:
    when ``config.vocab_size`` is GPT-2's 50,257. ``dtype``: cast floating-point weights.
    """
    from safetensors.torch import save_file

    from lightning_disttrain.data.hf_tokenizer import GPT2_VOCAB, write_gpt2_tokenizer

    if tokenizer and config.vocab_size != GPT2_VOCAB:
        raise ValueError(f"tokenizer=True writes GPT-2's BPE ({GPT2_VOCAB} tokens), but vocab_size="
                         f"{config.vocab_size}; export without the tokenizer files")
    tensors = hf_state_dict(config, state_dict)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    dtypes = {v.dtype for v in tensors.values()}
    hf_config = config_to_hf(config, dtype=dtypes.pop() if len(dtypes) == 1 else torch.float32)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / SAFETENSORS), metadata={"format": "pt"})  # transformers checks "format"
    # safetensors creates the file 0600 (a private temporary file, renamed); give it the mode any
    # other file written here gets (0644 under the usual umask), like config.json beside it.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(out / SAFETENSORS, 0o666 & ~umask)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    if tokenizer or (tokenizer is None and config.vocab_size == GPT2_VOCAB):
        write_gpt2_tokenizer(out, model_max_length=config.block_size)
    return out


def _plain_file_name(name: object) -> bool:
    """A bare file name: no directory part, not '.', '..', absolute or empty (a shard of a sharded
    checkpoint lives beside its index)."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name \
        and Path(name).name == name

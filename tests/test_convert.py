"""convert_model on tiny checkpoints: HF safetensors / sharded / .bin in, the engine's format out (cast once,
pre-sharded per tensor-parallel rank), bad input named, interrupted runs leaving nothing, the manifest cache.
The real GGUF model (SmolLM2) is converted in tests/test_real_model.py."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from pdcluster import convert_model
from pdcluster.engine.config import ModelConfig
from pdcluster.engine.convert import MANIFEST, ensure_converted, is_converted, read_manifest, source_sha256
from pdcluster.engine.testing import make_tiny_model
from pdcluster.engine.tp_shards import rank_file, split_dim


def _tensors(model_dir: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(os.listdir(model_dir)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(model_dir, f)))
    return out


def _greedy(model_dir: str, dtype: str) -> list[list[int]]:
    from pdcluster import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype=dtype, device="cpu", num_gpu_blocks_override=64)
    outs = llm.generate([[5, 17, 42, 99], [3, 1, 4, 1, 5, 9, 2, 6]], SamplingParams(temperature=0, max_tokens=12))
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_hf_safetensors_cast_once_and_loads(tiny_llama, tmp_path, dtype):
    out = convert_model(tiny_llama, str(tmp_path / "out"), dtype=dtype)
    src, conv = _tensors(tiny_llama), _tensors(out)
    assert set(conv) == set(src)
    for name, tensor in conv.items():
        assert tensor.dtype == getattr(torch, dtype)
        assert torch.equal(tensor, src[name].to(tensor.dtype)), name
    manifest = read_manifest(out)
    assert manifest["dtype"] == dtype and manifest["tensor_parallel_size"] == 1
    assert manifest["format_version"] == 1 and manifest["source"] == tiny_llama
    assert manifest["source_sha256"] == source_sha256(tiny_llama)
    assert set(manifest["files"]) >= {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"}
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["torch_dtype"] == dtype
    # the engine reads the converted dir; same weights in the same dtype -> the same greedy tokens
    assert _greedy(out, dtype) == _greedy(tiny_llama, dtype)


def test_tied_qwen2_and_sharded_source(tiny_qwen2, tmp_path):
    sharded = make_tiny_model(str(tmp_path / "sharded"), "qwen2", max_shard_size="100KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    out = convert_model(sharded, str(tmp_path / "out"), dtype="float32")
    conv = _tensors(out)
    assert "lm_head.weight" not in conv and "model.layers.0.self_attn.q_proj.bias" in conv
    assert _greedy(out, "float32") == _greedy(tiny_qwen2, "float32")


def test_bin_source(tiny_llama, tmp_path):
    src = tmp_path / "bin"
    src.mkdir()
    for f in os.listdir(tiny_llama):
        if not f.endswith(".safetensors"):
            (src / f).write_bytes(open(os.path.join(tiny_llama, f), "rb").read())
    torch.save(_tensors(tiny_llama), src / "pytorch_model.bin")
    from_bin = _tensors(convert_model(str(src), str(tmp_path / "a"), dtype="float16"))
    from_st = _tensors(convert_model(tiny_llama, str(tmp_path / "b"), dtype="float16"))
    assert set(from_bin) == set(from_st)
    assert all(torch.equal(from_bin[k], from_st[k]) for k in from_st)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_shards(tiny_llama, tmp_path, tp):
    """4 query heads, 2 KV heads: tp=2 splits the KV heads, tp=4 gives each rank a copy of one."""
    out = convert_model(tiny_llama, str(tmp_path / "out"), dtype="float32", tensor_parallel_size=tp)
    full = _tensors(convert_model(tiny_llama, str(tmp_path / "full"), dtype="float32"))
    cfg = ModelConfig.from_pretrained(out)
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert files == sorted(rank_file(r, tp) for r in range(tp))
    assert read_manifest(out)["tensor_parallel_size"] == tp
    ranks = [load_file(os.path.join(out, rank_file(r, tp))) for r in range(tp)]
    for name, tensor in full.items():
        parts = [r[name] for r in ranks]
        dim = split_dim(name)
        if dim is None:
            assert all(torch.equal(p, tensor) for p in parts), name
            continue
        if (".k_proj." in name or ".v_proj." in name) and cfg.num_kv_heads < tp:
            per = tp // cfg.num_kv_heads
            parts = parts[::per]   # each KV head held by `per` consecutive ranks
            assert all(torch.equal(ranks[r][name], ranks[r - r % per][name]) for r in range(tp))
        assert all(p.shape[dim] * len(parts) == tensor.shape[dim] for p in parts), name   # only its part
        assert torch.equal(torch.cat(parts, dim), tensor), name
    # column-parallel q / row-parallel o: rank r holds query heads [r*H/tp, (r+1)*H/tp)
    q = full["model.layers.0.self_attn.q_proj.weight"]
    rows = q.shape[0] // tp
    assert torch.equal(ranks[1]["model.layers.0.self_attn.q_proj.weight"], q[rows:2 * rows])
    # the engine (tensor_parallel_size 1 for now) refuses a pre-sharded dir instead of loading it wrongly
    from pdcluster import LLM

    with pytest.raises(ValueError, match="tensor_parallel_size=%d" % tp):
        LLM(model=out, dtype="float32", device="cpu", num_gpu_blocks_override=16)


def test_tensor_parallel_size_must_divide(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="num_attention_heads 4"):
        convert_model(tiny_llama, str(tmp_path / "out"), tensor_parallel_size=3)
    assert not os.path.exists(tmp_path / "out")


# ---- bad input ----------------------------------------------------------------------------------------

def _copy(src: str, dst) -> str:
    dst.mkdir()
    for f in os.listdir(src):
        (dst / f).write_bytes(open(os.path.join(src, f), "rb").read())
    return str(dst)


def test_bad_config_names_file_and_field(tiny_llama, tmp_path):
    src = _copy(tiny_llama, tmp_path / "src")
    cfg_path = os.path.join(src, "config.json")
    cfg = json.load(open(cfg_path))
    del cfg["hidden_size"]
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ValueError, match=r"config\.json: field 'hidden_size' is missing"):
        convert_model(src, str(tmp_path / "out"))
    open(cfg_path, "w").write("{not json")
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON"):
        convert_model(src, str(tmp_path / "out"))


def test_bad_tensors_name_file_and_tensor(tiny_llama, tmp_path):
    src = _copy(tiny_llama, tmp_path / "src")
    weights = os.path.join(src, "model.safetensors")
    tensors = load_file(weights)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, weights)
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'model\.layers\.1\.mlp\.up_proj\.weight' "
                                         r"has shape \(3, 3\)"):
        convert_model(src, str(tmp_path / "out"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, weights)
    with pytest.raises(ValueError, match=r"tensors missing: \['model\.layers\.1\.mlp\.up_proj\.weight'\]"):
        convert_model(src, str(tmp_path / "out"))
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(128, 64)
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, weights)
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.mlp\.extra\.weight' is not a weight"):
        convert_model(src, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")
    assert [p for p in os.listdir(tmp_path) if "partial" in p] == []


def test_bad_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert_model(str(tmp_path / "nope"), str(tmp_path / "out"))
    txt = tmp_path / "weights.txt"
    txt.write_text("x")
    with pytest.raises(ValueError, match=r"weights\.txt is a file but not a \.gguf file"):
        convert_model(str(txt), str(tmp_path / "out"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + os.urandom(64))
    with pytest.raises(ValueError, match=r"junk\.gguf: not a readable GGUF file"):
        convert_model(str(junk), str(tmp_path / "out"))


def test_gguf_missing_field_is_named(tmp_path):
    from gguf import GGUFWriter

    path = str(tmp_path / "partial.gguf")
    writer = GGUFWriter(path, "llama")
    writer.add_context_length(128)   # no block_count, no embedding_length, ...
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"partial\.gguf: field 'llama\.block_count' is missing"):
        convert_model(path, str(tmp_path / "out"))


# ---- output directory: atomic, cached, refused when foreign ------------------------------------------------

def test_interrupted_conversion_leaves_nothing(tiny_llama, tmp_path):
    out = tmp_path / "out"

    def interrupt(done: int, total: int, name: str) -> None:
        if done == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert_model(tiny_llama, str(out), progress=interrupt)
    assert os.listdir(tmp_path) == []
    # an interrupted re-conversion keeps the earlier, whole output as it was
    convert_model(tiny_llama, str(out), dtype="float32")
    before = read_manifest(str(out))
    with pytest.raises(KeyboardInterrupt):
        convert_model(tiny_llama, str(out), dtype="float16", progress=interrupt)
    assert read_manifest(str(out)) == before and os.listdir(tmp_path) == ["out"]
    # a conversion killed outright leaves its temp dir (named after its pid): the next one removes it
    stale = tmp_path / ".out.partial-999999999-abc"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    convert_model(tiny_llama, str(out), dtype="float16")
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_manifest_cache(tiny_llama, tmp_path):
    out = str(tmp_path / "out")
    assert ensure_converted(tiny_llama, out, "float16") == (out, True)
    assert ensure_converted(tiny_llama, out, "float16") == (out, False)
    assert is_converted(out, tiny_llama, "fp16") and not is_converted(out, tiny_llama, "float32")
    assert not is_converted(out, tiny_llama, "float16", tensor_parallel_size=2)
    with open(os.path.join(out, "model.safetensors"), "r+b") as f:   # damaged: redone
        f.truncate(100)
    assert not is_converted(out, tiny_llama, "float16")
    assert ensure_converted(tiny_llama, out, "float16") == (out, True)
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert len(list(f.keys())) > 0
    os.remove(os.path.join(out, MANIFEST))   # no manifest: not trusted, redone
    assert ensure_converted(tiny_llama, out, "float16") == (out, True)
    other = make_tiny_model(str(tmp_path / "other"), "llama", seed=1)   # another source: redone
    assert not is_converted(out, other, "float16")


def test_refuses_to_replace_a_foreign_dir(tiny_llama, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="is not a pdcluster conversion"):
        convert_model(tiny_llama, str(out))
    assert (out / "notes.txt").read_text() == "keep me"
    assert sorted(os.listdir(tmp_path)) == ["mine"]


def test_cli_convert(tiny_llama, tmp_path):
    from pdcluster.cli.main import app

    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["convert", tiny_llama, str(out), "--dtype", "bfloat16",
                                      "--tensor-parallel-size", "2"])
    assert result.exit_code == 0, result.output
    assert read_manifest(str(out))["dtype"] == "bfloat16"
    assert os.path.isfile(out / rank_file(1, 2))
    result = CliRunner().invoke(app, ["convert", str(tmp_path / "missing"), str(tmp_path / "x")])
    assert result.exit_code == 2 and "does not exist" in result.output

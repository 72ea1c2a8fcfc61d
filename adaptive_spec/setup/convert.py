"""A GGUF file turned into a plain Hugging Face folder (fetch.py's step 4): transformers dequantizes it,
and the model is saved again without the GGUF quantization_config it would otherwise carry."""
from __future__ import annotations

import copy
import gc
from pathlib import Path

from ..errors import UserError, first_line
from .pair import disk_errors, log_step


def convert_gguf(gguf_path: Path, out_dir: Path, quiet: bool = False) -> Path:
    """Turn a GGUF file into a plain Hugging Face folder (safetensors in bf16); returns out_dir.
    The loaded model still carries the GGUF `quantization_config`, which would make a saved copy load as GGUF
    again, so it is rebuilt without it over the same tensors (no second copy of the weights)."""
    import torch

    dtype = torch.bfloat16
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise UserError(f"GGUF file {gguf_path} does not exist")
    tok, loaded = _load_gguf(gguf_path, dtype, quiet)
    model = _without_quantization_config(loaded, dtype, gguf_path.name)
    del loaded
    gc.collect()
    if tok.chat_template is None:
        log_step(f"warning: {gguf_path.name} carries no chat template; the saved tokenizer has none", quiet)
    out_dir.mkdir(parents=True, exist_ok=True)
    with disk_errors():
        model.save_pretrained(out_dir)
        tok.save_pretrained(out_dir)
    del model
    gc.collect()
    return out_dir


def _load_gguf(gguf_path: Path, dtype, quiet: bool):
    """(tokenizer, dequantized model) of a GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: the model registry; conversion only
    from transformers.utils import logging as hf_logging

    folder, name = str(gguf_path.parent), gguf_path.name
    # The GGUF loader warns that packed GGUF weights run fastest in float32; that does not
    # apply here (they are dequantized and saved), so keep its logs to errors while loading.
    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        # Loading straight in `dtype` dequantizes into it: half the memory of float32, and the
        # same numbers as dequantizing to float32 and casting afterwards.
        return tok, AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    except (OSError, ValueError) as e:
        raise UserError(f"transformers could not load {gguf_path} as a GGUF model ({first_line(e)})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _without_quantization_config(loaded, dtype, name: str):
    """The same model, rebuilt from a config without the GGUF quantization_config, holding the
    loaded tensors themselves."""
    from transformers import AutoModelForCausalLM  # heavy: as in _load_gguf

    try:
        from transformers.initialization import no_init_weights  # heavy: as above
    except ImportError:  # older transformers
        from transformers.modeling_utils import no_init_weights  # heavy: as above

    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    with no_init_weights():  # the weights are replaced right away: skip random init
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = loaded.state_dict()
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()  # assign=True gives tied names separate Parameters; share them again
    model.generation_config = copy.deepcopy(loaded.generation_config)
    # Cheap proof the rebuilt model holds exactly the loaded tensors (same storage, no copies).
    new_state = model.state_dict()
    moved = [k for k, v in state.items() if new_state[k].data_ptr() != v.data_ptr()]
    if moved:
        raise RuntimeError(f"rebuilding {name} without quantization_config changed {moved[:3]}")
    return model

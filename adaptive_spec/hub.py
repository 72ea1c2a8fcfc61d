"""A saved model of this package (the acceptance head, the feature drafter): a folder or a hub repo with
config.json and model.safetensors, written and read through huggingface_hub's PyTorchModelHubMixin
(`from_pretrained` by folder or hub id, `push_to_hub`), every failure a UserError that says what to do."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from huggingface_hub import PyTorchModelHubMixin, hf_hub_download
from huggingface_hub.errors import EntryNotFoundError
from huggingface_hub.utils import HFValidationError, validate_repo_id
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from .errors import UserError, first_line
from .runs import atomic_write

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
_HUB_ARGS = ("revision", "cache_dir", "force_download", "local_files_only", "token")


class HubModel(PyTorchModelHubMixin):
    """The shared half of a saved model; the class (an nn.Module) gives `config_dict`, `_from_config(config,
    where, **checks)` (its config format: refuse a foreign one, build the model) and the texts of its errors."""
    _NAME: str  # what the messages call it
    _SAVED: str  # "it is not a saved ..."
    _NO_WEIGHTS: str  # a folder without weights: .format(folder, WEIGHTS_NAME), then _FIX
    _REEXPORT: str  # what to do about a corrupt file, before _FIX
    _FIX: str  # how to get one
    _ANCHOR: str  # the layer whose weight gives the model's dtype and device

    @property
    def dtype(self) -> torch.dtype:
        return getattr(self, self._ANCHOR).weight.dtype

    @property
    def device(self) -> torch.device:
        return getattr(self, self._ANCHOR).weight.device

    def save_pretrained(self, save_directory: str | Path, extra: dict | None = None, **kwargs) -> Path:
        """Write config.json + model.safetensors (and the mixin's model card) to a folder and return it. `extra`
        (training metadata) goes into config.json and becomes `self.extra`; kwargs are the mixin's (push_to_hub)."""
        if extra is not None:
            self.extra = dict(extra)
        kwargs.pop("config", None)  # push_to_hub passes the mixin's config; ours is written by _save_pretrained
        super().save_pretrained(save_directory, **kwargs)
        return Path(save_directory)

    def _save_pretrained(self, save_directory: Path) -> None:
        # Each file is replaced whole (tmp + rename), so a kill never leaves a half-written one. `_save_dtype`:
        # the floating weights' dtype on disk where the class sets one (None: as they are).
        dt = getattr(self, "_save_dtype", None)
        state = {k: (v.to(dt) if dt is not None and v.is_floating_point() else v).detach().to("cpu").contiguous()
                 for k, v in self.state_dict().items()}
        atomic_write(save_directory / WEIGHTS_NAME, save(state, metadata={"format": "pt"}))
        atomic_write(save_directory / CONFIG_NAME, json.dumps(self.config_dict(self.extra), indent=2, default=str) + "\n")

    @classmethod
    def _load(cls, name_or_path: str | Path, device, dtype, hub_kwargs: dict, **checks):
        """The mixin's from_pretrained (hub_kwargs: revision, token, cache_dir, local_files_only, force_download)
        with its failures as UserErrors; `checks` describe what the caller uses, for `_from_config` to refuse a
        model made for another."""
        name = str(Path(name_or_path).expanduser())
        if not os.path.isdir(name) and not _is_repo_id(name):
            raise UserError(f"{cls._NAME} folder {name} does not exist; {cls._FIX}")
        try:
            # checks=, not the checks' names: the mixin would take hidden_size as the architecture.
            return super().from_pretrained(name, checks=checks, device=device, dtype=dtype, **hub_kwargs)
        except ValueError as e:  # the mixin parses config.json before handing over
            raise UserError(f"{name}/{CONFIG_NAME} is corrupt ({type(e).__name__}: {e}); {cls._REEXPORT}"
                            f"{cls._FIX}") from None
        except OSError as e:  # hub: offline, no such repo or file
            raise UserError(f"{cls._NAME} {name} is not a local folder and could not be fetched from the Hugging "
                            f"Face hub ({first_line(e)}); {cls._FIX}") from None

    @classmethod
    def _from_pretrained(cls, *, model_id: str, config: dict | None = None, checks: dict | None = None, device=None,
                         dtype=None, **hub):
        # Init arguments the mixin read from config.json arrive in `hub` too: unused, `config` is checked instead.
        where = model_id if os.path.isdir(model_id) else f"hub repo {model_id}"
        model = cls._from_config(config, where, **(checks or {}))
        try:
            model.load_state_dict(load_file(cls._weights_file(model_id, where, hub)), strict=True)
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise UserError(f"{where}/{WEIGHTS_NAME} is corrupt or does not match {CONFIG_NAME} ({first_line(e)}); "
                            f"{cls._REEXPORT}{cls._FIX}") from None
        model.extra = {k: v for k, v in config.items() if k not in model.config_dict()}
        return model.to(device=device, dtype=dtype).eval()

    @classmethod
    def _weights_file(cls, model_id: str, where: str, hub: dict) -> str:
        """model.safetensors of a local folder, or downloaded (cached) from the hub repo."""
        if os.path.isdir(model_id):
            path = os.path.join(model_id, WEIGHTS_NAME)
            if not os.path.isfile(path):
                raise UserError(cls._NO_WEIGHTS.format(model_id, WEIGHTS_NAME) + cls._FIX)
            return path
        try:
            return hf_hub_download(model_id, WEIGHTS_NAME, **{k: hub.get(k) for k in _HUB_ARGS})
        except EntryNotFoundError:
            raise UserError(f"{where} has no {WEIGHTS_NAME}; it is not a saved {cls._SAVED}; {cls._FIX}") from None


def _is_repo_id(name: str) -> bool:
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True

